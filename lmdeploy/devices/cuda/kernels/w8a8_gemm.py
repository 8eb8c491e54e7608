"""SmoothQuant int8's GEMM for more than a few rows: int8 x int8 on tensor cores, int32 accumulators, and the
scales (a_scale[row] * weight_scale[col]), the cast and the bias applied in the same kernel.

Measured on an H100 (Llama-3-8B's layers, the input already quantized):
- From 256 rows, ``torch._int_mm`` (cuBLASLt) plus the separate epilogue ran at 0.67-0.99x bf16's speed. The
  int32 result is written and read again, and cuBLASLt's int8 kernel choice is poor for these shapes.
- This kernel took 0.59-0.84x of bf16's time there.
- Up to 64 rows the GEMM streams the weight and ``_int_mm`` is as fast, so devices/cuda/w8a8.py keeps it there.

With the op before the layer and its quantization included (benchmark/w8a8_gemm.py --with-producer; the
quantization fused into that op, session 51, H200, choose()'s tiles): at 256 rows q|k|v, gate|up and down take
1.00x, 0.71x and 0.95x bf16's time; from 1,024 rows 0.58-0.77x.

The epilogue rounds as kernels/w8a8_quant.py's ``scale_epilogue`` does, so either path gives the same values.
"""
import torch
import triton
import triton.language as tl

from . import pdl
from .limits import shared_memory
from .tiles import grouped_tile


@triton.jit
def _int8_gemm_kernel(a_ptr, w_ptr, as_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_am, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = offs_m < M, offs_n < N
    rows_m = offs_m.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_mask = offs_k < K
        a = tl.load(a_ptr + rows_m[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0)
        acc += tl.dot(a, w)
    sa = tl.load(as_ptr + offs_m, mask=m_mask, other=0.0)
    sw = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    dt = out_ptr.dtype.element_ty
    y = (acc.to(tl.float32) * sa[:, None] * sw[None, :]).to(dt)
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(dt).to(tl.float32)
        y = (y.to(tl.float32) + b[None, :]).to(dt)
    tl.store(out_ptr + rows_m[:, None] * stride_om + offs_n[None, :], y, mask=m_mask[:, None] & n_mask[None, :])


# (BM, BN) from the largest: (BK, warps, stages); a session-51 sweep on an H200 (benchmark/w8a8_gemm.py
# --int8-sweep, Llama-3-8B's layers at 128, 256 and 512 rows)
TILES = (((128, 128), (128, 8, 3)), ((128, 64), (128, 4, 4)), ((64, 128), (128, 4, 4)), ((64, 64), (128, 4, 5)))
WAVES = 1.4  # programs per SM a tile must give to be taken


def choose(m: int, n: int, k: int, num_sms: int = 132, smem: int = 227 * 1024):
    """(BM, BN, BK, warps, stages): the largest tile of :data:`TILES` that gives WAVES programs per SM; else
    64 x 64, its K step 256 where even that leaves SMs idle (fewer programs than SMs: each does more per step).
    Stages shrink to what ``smem`` bytes of shared memory hold.

    The sweep's gains over the one tile per row count used before (64 x 128 to 256 rows, 128 x 128 above), us
    per call: at 256 rows o 18.4 -> 12.4, gate_up 79.0 -> 58.1, down 50.4 -> 37.3; at 128 rows down 50.7 ->
    24.4; at 512 rows down 79.9 -> 56.1. Narrow layers (N 4,096-6,144) at a few hundred rows want more, smaller
    tiles to fill the GPU; gate_up (N 28,672) keeps 128 x 128 from 128 rows on."""
    for (bm, bn), (bk, warps, stages) in TILES:
        if -(-m // bm) * -(-n // bn) >= WAVES * num_sms:
            break
    else:
        bm, bn, (bk, warps, stages) = 64, 64, TILES[-1][1]
        if -(-m // bm) * -(-n // bn) < num_sms:
            bk = 256
    stages = max(2, min(stages, smem // ((bm + bn) * bk)))
    return bm, bn, bk, warps, stages


def int8_gemm_scaled(q: torch.Tensor, weight: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias,
                     dtype: torch.dtype, rows: int = None, config=None, num_sms: int = 132) -> torch.Tensor:
    """out [rows, N] (dtype) = (q[:rows] @ weight^T) * a_scale[:rows] * w_scale (+ bias), of q int8 [>= rows, K]
    (row-major), weight int8 [N, K] (row-major), a_scale float32 [>= rows, 1], w_scale float32 [N].
    ``config``: (BM, BN, BK, warps, stages) instead of :func:`choose`'s (a sweep's); ``num_sms``: the GPU's."""
    rows = q.shape[0] if rows is None else rows
    n, k = weight.shape
    out = torch.empty((rows, n), dtype=dtype, device=q.device)
    if rows == 0 or n == 0:
        return out
    smem = shared_memory(q.device) if q.is_cuda else 227 * 1024
    bm, bn, bk, warps, stages = config or choose(rows, n, k, num_sms, smem)
    grid = (triton.cdiv(rows, bm) * triton.cdiv(n, bn), )
    _int8_gemm_kernel[grid](q, weight, a_scale, w_scale, bias if bias is not None else w_scale, out, rows, n, k,
                            q.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BM=bm, BN=bn,
                            BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages, PDL=pdl.ON, **pdl.LAUNCH)
    return out
