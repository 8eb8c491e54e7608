"""SmoothQuant W8A8's two memory-bound steps around the 8-bit GEMM (devices/cuda/w8a8.py):

* ``quantize_per_token``: an activation's dynamic per-token quantization in one launch (one program per row:
  the row's amax, then the row scaled and rounded), the same values as the reference's (devices/w8a8.py): the
  scale and x / scale are divided correctly rounded (``div_rn``: Triton's ``/`` may be approximate on a GPU),
  int8 rounds half to even (as torch.round; built from floor, which the interpreter also runs), e4m3 rounds
  the value clamped to +-448 to nearest even on e4m3's grid in float32 before the cast (the interpreter's own
  fp32 -> e4m3 cast drops the carry when rounding up crosses a power of two: 1.99 -> 1.0).
* ``scale_epilogue``: an int32 (or float32) GEMM result times a_scale[row] * weight_scale[col], cast to the
  activation dtype, plus the bias (rounded to that dtype first, as the reference adds it).
"""
import torch
import triton
import triton.language as tl

from . import pdl

INT8_MAX = 127.0
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


@triton.jit
def _round_half_even(y):
    """torch.round of float32 values (ties to even), from floor: the interpreter has no rint."""
    r = tl.floor(y)
    f = y - r  # exact
    half = r * 0.5
    odd = half != tl.floor(half)
    return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, n_rows, n_cols, stride_x, stride_q, QMAX: tl.constexpr, FP8: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    row = tl.program_id(0)
    n_live = tl.where(row < n_rows, n_cols, 0)  # rows past the input (padding for the GEMM) come out as zeros
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = q_ptr + row.to(tl.int64) * stride_q
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, n_cols, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_live, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), QMAX)
    for k0 in range(0, n_cols, BLOCK):  # the row again (from cache)
        cols = k0 + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=cols < n_live, other=0.0).to(tl.float32)
        y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
        if FP8:
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
            # e4m3's spacing at y: 2^(exponent - 3), 2^-9 among the subnormals (exponent < -6); y rounded to
            # it exactly (powers of two), so the cast below has nothing left to round
            bits = y.to(tl.int32, bitcast=True)
            e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
            ulp = ((e + 127) << 23).to(tl.float32, bitcast=True)
            inv_ulp = ((127 - e) << 23).to(tl.float32, bitcast=True)
            v = _round_half_even(tl.abs(y) * inv_ulp) * ulp
            # the sign put back as a bit: a negative value rounded to 0 stays -0 as the reference's cast keeps
            # it (negating a float here lost the sign of zero on a GPU)
            signed = (v.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
            q = signed.to(tl.float8e4nv)
        else:
            q = tl.minimum(tl.maximum(_round_half_even(y), -QMAX), QMAX).to(tl.int8)
        tl.store(q_row + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_per_token(x: torch.Tensor, fp8: bool, min_rows: int = 0, block: int = 2048):
    """(x_q [max(M, min_rows), K] int8 / e4m3, a_scale float32 [max(M, min_rows), 1]) of x [M, K] (bf16 / fp16 /
    float32); rows past M (``min_rows``: cuda's torch._int_mm wants more than 16) are zeros."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    rows = max(m, min_rows)
    q = torch.empty((rows, k), dtype=FP8_DTYPE if fp8 else torch.int8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = min(block, triton.next_power_of_2(max(k, 16)))
    _quant_kernel[(rows, )](x, q, scale, m, k, x.stride(0), q.stride(0), QMAX=FP8_MAX if fp8 else INT8_MAX, FP8=fp8,
                            BLOCK=block, num_warps=4 if block <= 1024 else 8, PDL=pdl.ON, **pdl.LAUNCH)
    return q, scale


@triton.jit
def _epilogue_kernel(acc_ptr, as_ptr, ws_ptr, b_ptr, out_ptr, n_rows, n_cols, stride_acc, stride_out,
                     HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask, cmask = rows < n_rows, cols < n_cols
    mask = rmask[:, None] & cmask[None, :]
    acc = tl.load(acc_ptr + rows.to(tl.int64)[:, None] * stride_acc + cols[None, :], mask=mask, other=0).to(tl.float32)
    a = tl.load(as_ptr + rows, mask=rmask, other=0.0)
    w = tl.load(ws_ptr + cols, mask=cmask, other=0.0)
    dt = out_ptr.dtype.element_ty
    y = (acc * a[:, None] * w[None, :]).to(dt)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(dt).to(tl.float32)
        y = (y.to(tl.float32) + b[None, :]).to(dt)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], y, mask=mask)


def scale_epilogue(acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias, dtype: torch.dtype,
                   rows: int = None) -> torch.Tensor:
    """out [rows, N] (dtype) = acc[:rows] * a_scale[:rows] * w_scale (+ bias) of a GEMM's acc [>= rows, N] (int32
    or float32, row-major), a_scale [>= rows, 1] and w_scale [N] float32."""
    rows = acc.shape[0] if rows is None else rows
    n = acc.shape[1]
    out = torch.empty((rows, n), dtype=dtype, device=acc.device)
    if rows == 0 or n == 0:
        return out
    bm = min(32, triton.next_power_of_2(rows))
    bn = min(128, triton.next_power_of_2(n))
    grid = (triton.cdiv(rows, bm), triton.cdiv(n, bn))
    _epilogue_kernel[grid](acc, a_scale, w_scale, bias if bias is not None else w_scale, out, rows, n, acc.stride(0),
                           out.stride(0), HAS_BIAS=bias is not None, BM=bm, BN=bn, num_warps=4, PDL=pdl.ON,
                           **pdl.LAUNCH)
    return out
