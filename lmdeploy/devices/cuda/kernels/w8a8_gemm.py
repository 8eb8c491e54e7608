"""SmoothQuant int8's GEMM for more than a few rows: int8 x int8 on tensor cores, int32 accumulators, and the
scales (a_scale[row] * weight_scale[col]), the cast and the bias applied in the same kernel.

Measured on an H100 (Llama-3-8B's layers, the input already quantized):
- From 256 rows, ``torch._int_mm`` (cuBLASLt) plus the separate epilogue ran at 0.67-0.99x bf16's speed. The
  int32 result is written and read again, and cuBLASLt's int8 kernel choice is poor for these shapes.
- This kernel took 0.59-0.84x of bf16's time there.
- Up to 64 rows the GEMM streams the weight and ``_int_mm`` is as fast, so devices/cuda/w8a8.py keeps it there.

With the per-token quantize included (benchmark/w8a8_gemm.py), a layer at 256 rows is still 0.8-1.2x bf16's
time. The separate quantize pass costs that; fusing it into the norm is not done.

The epilogue rounds as kernels/w8a8_quant.py's ``scale_epilogue`` does, so either path gives the same values.
"""
import torch
import triton
import triton.language as tl

from . import pdl
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


def choose(m: int):
    """(BM, BN, BK, warps, stages) by rows (the fastest of a sweep on an H100 over Llama-3-8B's shapes)."""
    if m <= 256:
        return 64, 128, 128, 4, 4
    return 128, 128, 128, 8, 3


def int8_gemm_scaled(q: torch.Tensor, weight: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias,
                     dtype: torch.dtype, rows: int = None) -> torch.Tensor:
    """out [rows, N] (dtype) = (q[:rows] @ weight^T) * a_scale[:rows] * w_scale (+ bias), of q int8 [>= rows, K]
    (row-major), weight int8 [N, K] (row-major), a_scale float32 [>= rows, 1], w_scale float32 [N]."""
    rows = q.shape[0] if rows is None else rows
    n, k = weight.shape
    out = torch.empty((rows, n), dtype=dtype, device=q.device)
    if rows == 0 or n == 0:
        return out
    bm, bn, bk, warps, stages = choose(rows)
    grid = (triton.cdiv(rows, bm) * triton.cdiv(n, bn), )
    _int8_gemm_kernel[grid](q, weight, a_scale, w_scale, bias if bias is not None else w_scale, out, rows, n, k,
                            q.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BM=bm, BN=bn,
                            BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages, PDL=pdl.ON, **pdl.LAUNCH)
    return out
