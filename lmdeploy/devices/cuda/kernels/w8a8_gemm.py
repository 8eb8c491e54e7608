"""SmoothQuant int8's GEMM for more than a few rows: int8 x int8 on tensor cores, int32 accumulators, with the
scales (a_scale[row] * weight_scale[col]), the cast and the bias applied in the same kernel; and the gated MLP's
gate|up GEMM with silu(gate) * up in that epilogue as well (``gated_gemm_scaled``).

Measured on an H100 (Llama-3-8B's layers, the input already quantized):
- From 256 rows, ``torch._int_mm`` (cuBLASLt) plus the separate epilogue ran at 0.67-0.99x bf16's speed. The
  int32 result is written and read again, and cuBLASLt's int8 kernel choice is poor for these shapes.
- This kernel took 0.59-0.84x of bf16's time there.
- Up to 64 rows the GEMM streams the weight and ``_int_mm`` is as fast, so devices/cuda/w8a8.py keeps it there.

With the op before the layer and its quantization included (benchmark/w8a8_gemm.py --with-producer; the
quantization fused into that op, session 51, H200, choose()'s tiles): at 256 rows q|k|v, gate|up and down take
1.00x, 0.71x and 0.95x bf16's time; from 1,024 rows 0.58-0.77x.

On Hopper the plain GEMM's tiles arrive through TMA descriptors (:func:`tma_ok`): against the same tiles read
through pointers, at 256 rows qkv 18.5 -> 15.3 us, o 13.2 -> 11.4, down 45.7 (37.8 in another sweep) -> 34.1,
and 5-8 % faster from 1,024 to 4,096 rows (H200, session 53; end to end +0.6 % on the 2000 requests, +0.5 %
prefill-heavy). Persistent variants (with and without Triton's warp specialisation) were no faster; a split
over K (the last program adding the int32 partial sums) lost or tied at every size. The gated GEMM reads gate
and up rows in turns, which one descriptor's block cannot.

The epilogue rounds as kernels/w8a8_quant.py's ``scale_epilogue`` does, so either path gives the same values.
(An e4m3 variant of this kernel, on an H200 in session 52 at 256 rows, took 1.03-1.66x torch._scaled_mm's time
with choose()'s tiles and 0.85-1.29x with the best of 81 per layer: fp8 keeps cuBLAS.)

The gated GEMM: the down projection after it needs its input's per-token scale, the largest |silu(gate) * up|
of the whole row, which no tile of the GEMM sees alone. Each program therefore writes its tile of the 16-bit
activation (half the bytes of gate|up's output) and an atomic max of its rows' |values| (float32 bits as int32:
ordered as the floats are, all of them >= 0); kernels/w8a8_quant.quantize_with_amax then codes the activation
elementwise, with no row-long reduction left (a one-program-a-row quantize of a 14,336-wide row holds the row
in registers and runs at a few rows per SM).
"""
import functools

import torch
import triton
import triton.language as tl

from . import pdl
from .limits import capability, shared_memory
from .tiles import grouped_tile


@triton.jit
def _scaled(acc, sa, sw, b_ptr, offs_n, n_mask, HAS_BIAS: tl.constexpr, dt: tl.constexpr):
    """acc * a_scale[row] * w_scale[col] cast to dt, plus the bias rounded to dt (the reference's order)."""
    y = (acc.to(tl.float32) * sa[:, None] * sw[None, :]).to(dt)
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(dt).to(tl.float32)
        y = (y.to(tl.float32) + b[None, :]).to(dt)
    return y


@triton.jit
def _dot_rows(a_ptr, w_ptr, rows_m, m_mask, w_rows, w_mask, K, stride_am, stride_wn, BM: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr):
    """The int32 [BM, BN] tile sum_k a[rows_m, k] * w[w_rows, k] (masked rows and columns read as zeros)."""
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_mask = offs_k < K
        a = tl.load(a_ptr + rows_m[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0)
        w = tl.load(w_ptr + w_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=w_mask[None, :] & k_mask[:, None], other=0)
        acc += tl.dot(a, w)
    return acc


@triton.jit
def _dot_tiles(a_desc, w_desc, row0, col0, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """:func:`_dot_rows`' tile through tensor-memory-access descriptors (Hopper on): a [BM, BK] and w [BN, BK]
    tiles copied into shared memory by the TMA unit, rows and columns past the ends read as zeros."""
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        acc += tl.dot(a_desc.load([row0, k0]), w_desc.load([col0, k0]).T)
    return acc


@triton.jit
def _int8_gemm_kernel(a_ptr, w_ptr, as_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_am, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr):
    """One [BM, BN] output tile. ``TMA``: ``a_ptr`` and ``w_ptr`` are tensor descriptors of q and the weight
    (blocks [BM, BK] and [BN, BK]), not pointers."""
    pdl.wait_then_release(PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = offs_m < M, offs_n < N
    rows_m = offs_m.to(tl.int64)
    if TMA:
        acc = _dot_tiles(a_ptr, w_ptr, pid_m * BM, pid_n * BN, K, BM, BN, BK)
    else:
        acc = _dot_rows(a_ptr, w_ptr, rows_m, m_mask, offs_n, n_mask, K, stride_am, stride_wn, BM, BN, BK)
    sa = tl.load(as_ptr + offs_m, mask=m_mask, other=0.0)
    sw = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    y = _scaled(acc, sa, sw, b_ptr, offs_n, n_mask, HAS_BIAS, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows_m[:, None] * stride_om + offs_n[None, :], y, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gated_gemm_kernel(a_ptr, w_ptr, as_ptr, ws_ptr, b_ptr, act_ptr, amax_ptr, M, I, K, stride_am, stride_wn,
                       stride_om, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """A tile of silu(gate) * up for a weight [gate; up] ([2I, K]): its BN columns of the GEMM are BN / 2 gate
    columns and the same up columns taken in turns (gate j, up j, ...: one dot as wide as the plain GEMM's, its
    result split in registers), each scaled and rounded as the plain GEMM's output, then the activation rounded
    as kernels/activation.py's."""
    HALF: tl.constexpr = BN // 2
    pdl.wait_then_release(PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, I, BM, HALF, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_mask = offs_m < M
    rows_m = offs_m.to(tl.int64)
    j = tl.arange(0, BN)
    w_rows = pid_n * HALF + j // 2 + (j % 2) * I  # the weight rows of the tile's columns, gate and up in turns
    w_mask = pid_n * HALF + j // 2 < I
    acc = _dot_rows(a_ptr, w_ptr, rows_m, m_mask, w_rows, w_mask, K, stride_am, stride_wn, BM, BN, BK)
    dt = act_ptr.dtype.element_ty
    sa = tl.load(as_ptr + offs_m, mask=m_mask, other=0.0)
    both = _scaled(acc, sa, tl.load(ws_ptr + w_rows, mask=w_mask, other=0.0), b_ptr, w_rows, w_mask, HAS_BIAS, dt)
    gate, up = tl.split(tl.reshape(both.to(tl.float32), (BM, HALF, 2)))
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    y = (act * up).to(dt)
    offs_n = pid_n * HALF + tl.arange(0, HALF)
    mask = m_mask[:, None] & (offs_n < I)[None, :]
    tl.store(act_ptr + rows_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)
    tile_max = tl.max(tl.where(mask, tl.abs(y.to(tl.float32)), 0.0), axis=1)
    tl.atomic_max(amax_ptr + offs_m, tile_max.to(tl.int32, bitcast=True), mask=m_mask)


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
    tiles to fill the GPU; gate_up (N 28,672) keeps 128 x 128 from 128 rows on. Up to 64 rows (the gated
    GEMM runs there; the plain one leaves them to torch._int_mm) a 128-row tile is half padding: gate|up at 17-64
    rows took 36-38 us with 64 x 128 against 42-46 with 128 x 128 (H200, session 52)."""
    for (bm, bn), (bk, warps, stages) in TILES:
        if bm > 64 >= m:  # a few rows (the gated GEMM's decode steps): 64-row tiles waste half as much
            continue
        if -(-m // bm) * -(-n // bn) >= WAVES * num_sms:
            break
    else:
        bm, bn, (bk, warps, stages) = 64, 64, TILES[-1][1]
        if -(-m // bm) * -(-n // bn) < num_sms:
            bk = 256
    stages = max(2, min(stages, smem // ((bm + bn) * bk)))
    return bm, bn, bk, warps, stages


def _config(q, m, n, k, config, num_sms):
    smem = shared_memory(q.device) if q.is_cuda else 227 * 1024
    return config or choose(m, n, k, num_sms, smem)


def tma_ok(q: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the plain GEMM takes its tiles through TMA descriptors: Hopper on (sm90+), a Triton that has
    host-side descriptors, and rows that start on 16-byte boundaries (K a multiple of 16)."""
    if not (q.is_cuda and capability(q.device)[0] >= 9 and _TensorDescriptor() is not None):
        return False
    return all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (q, weight))


@functools.lru_cache(maxsize=None)
def _TensorDescriptor():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
        return TensorDescriptor
    except ImportError:
        return None


def int8_gemm_scaled(q: torch.Tensor, weight: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias,
                     dtype: torch.dtype, rows: int = None, config=None, num_sms: int = 132,
                     tma: bool = None) -> torch.Tensor:
    """out [rows, N] (dtype) = (q[:rows] @ weight^T) * a_scale[:rows] * w_scale (+ bias), of q int8 [>= rows, K]
    (row-major), weight int8 [N, K] (row-major), a_scale float32 [>= rows, 1], w_scale float32 [N].
    ``config``: (BM, BN, BK, warps, stages) instead of :func:`choose`'s (a sweep's); ``num_sms``: the GPU's;
    ``tma``: the tiles through TMA descriptors (by default where :func:`tma_ok`)."""
    rows = q.shape[0] if rows is None else rows
    n, k = weight.shape
    out = torch.empty((rows, n), dtype=dtype, device=q.device)
    if rows == 0 or n == 0:
        return out
    bm, bn, bk, warps, stages = _config(q, rows, n, k, config, num_sms)
    use_tma = tma_ok(q, weight) if tma is None else tma
    a, w = q, weight
    if use_tma:
        desc = _TensorDescriptor()
        a, w = desc.from_tensor(q[:rows], [bm, bk]), desc.from_tensor(weight, [bn, bk])
    grid = (triton.cdiv(rows, bm) * triton.cdiv(n, bn), )
    _int8_gemm_kernel[grid](a, w, a_scale, w_scale, bias if bias is not None else w_scale, out, rows, n, k,
                            q.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BM=bm, BN=bn,
                            BK=bk, GROUP_M=8, TMA=use_tma, num_warps=warps, num_stages=stages, PDL=pdl.ON,
                            **pdl.LAUNCH)
    return out


def gated_gemm_scaled(q: torch.Tensor, weight: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias,
                      dtype: torch.dtype, rows: int = None, config=None, num_sms: int = 132):
    """(act [rows, I] dtype, amax int32 [rows]) of a gate|up weight [2I, K]: act = silu(gate) * up of
    :func:`int8_gemm_scaled`'s output (gate its first I columns), rounded as kernels/activation.py's
    silu_and_mul rounds it; amax[row] the float32 bits of max |act[row]| (kernels/w8a8_quant.quantize_with_amax
    reads it). ``config`` is a tile of the whole [rows, 2I] GEMM (:func:`choose`'s): each program computes BN / 2
    gate and the same BN / 2 up columns, in one BM x BN dot."""
    rows = q.shape[0] if rows is None else rows
    n, k = weight.shape
    half = n // 2
    act = torch.empty((rows, half), dtype=dtype, device=q.device)
    amax = torch.zeros((rows, ), dtype=torch.int32, device=q.device)
    if rows == 0 or half == 0:
        return act, amax
    bm, bn, bk, warps, stages = _config(q, rows, n, k, config, num_sms)
    grid = (triton.cdiv(rows, bm) * triton.cdiv(half, bn // 2), )
    _gated_gemm_kernel[grid](q, weight, a_scale, w_scale, bias if bias is not None else w_scale, act, amax, rows,
                             half, k, q.stride(0), weight.stride(0), act.stride(0), HAS_BIAS=bias is not None, BM=bm,
                             BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages, PDL=pdl.ON, **pdl.LAUNCH)
    return act, amax
