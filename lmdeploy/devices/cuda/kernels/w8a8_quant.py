"""SmoothQuant W8A8's memory-bound steps around the 8-bit GEMM (devices/cuda/w8a8.py):

* ``quantize_per_token``: an activation's dynamic per-token quantization in one launch (one program per row:
  the row's amax, then the row scaled and rounded), the same values as the reference's (devices/w8a8.py): the
  scale and x / scale are divided correctly rounded (``div_rn``: Triton's ``/`` may be approximate on a GPU),
  int8 rounds half to even (as torch.round; built from floor, which the interpreter also runs), e4m3 rounds
  the value clamped to +-448 to nearest even on e4m3's grid in float32 before the cast (the interpreter's own
  fp32 -> e4m3 cast drops the carry when rounding up crosses a power of two: 1.99 -> 1.0).
* ``rms_norm_quant`` / ``silu_and_mul_quant``: the op before an 8-bit layer (kernels/norm.py's rms_norm,
  kernels/activation.py's silu_and_mul) with that quantization in the same program: the 16-bit output is
  computed and rounded as those kernels round it, then coded, never written. One program per row; a row up to
  ONE_PASS_COLS long is held in registers, a longer one is read twice (its amax first). The norm's loads and
  stores are rms_norm's, but Triton may still lay the row over the threads otherwise (the 8-bit stores weigh in),
  and the sum of squares then rounds otherwise: on an H200, one row in 1,024 of a 4,096-wide layer input came
  out with codes a step apart (both as close to the reference).
* ``quantize_with_amax``: the same codes of a row whose max |value| is already known (the gated GEMM's, which
  writes silu(gate) * up and that max: kernels/w8a8_gemm.py), many programs a row.
* ``scale_epilogue``: an int32 (or float32) GEMM result times a_scale[row] * weight_scale[col], cast to the
  activation dtype, plus the bias (rounded to that dtype first, as the reference adds it).
"""
import torch
import triton
import triton.language as tl

from . import pdl
from .norm import normed_row, row_warps

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
def _codes(x, scale, QMAX: tl.constexpr, FP8: tl.constexpr):
    """x / scale (float32 values, a float32 scale) as int8 or e4m3 codes, rounded as the reference rounds."""
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
    return q


@triton.jit
def _scale_from_max(m, QMAX: tl.constexpr):
    """A row's scale from its max |value| (the reference's rule: at least 1e-12, divided correctly rounded)."""
    return tl.math.div_rn(tl.maximum(m, 1e-12), QMAX)


@triton.jit
def _scale_of(amax, QMAX: tl.constexpr):
    return _scale_from_max(tl.max(amax, axis=0), QMAX)


ONE_PASS_COLS = 16384  # a row up to this long is held in registers (one read); longer ones are read twice


def _block_and_warps(cols: int, block=None):
    """(BLOCK, warps) of a one-program-per-row kernel: the whole row in one block where it fits (one read, and a
    few rows' programs still keep enough loads in flight), else ``block`` (default 2048) columns a step."""
    whole = triton.next_power_of_2(max(cols, 16))
    if block is None:
        block = whole if whole <= ONE_PASS_COLS else 2048
    block = min(block, whole)
    # a warp per 256 columns up to 16 (an H200's sweep: 4,096 columns 3.6 us at 256 rows with 16 warps, 5.7 in
    # 2,048-column steps with 4; 14,336 columns 12.5 us with 16 warps, 19.7 with 4)
    return block, max(4, min(16, block // 256))


@triton.jit
def _row_values(x_row, cols, live, n_cols, GATED: tl.constexpr):
    """The float32 values at ``cols`` of a row: the row's own, or (GATED) silu(gate) * up of a row [gate | up]
    of n_cols each, rounded to its dtype as kernels/activation.py rounds it."""
    if GATED:
        dt = x_row.dtype.element_ty
        gate = tl.load(x_row + cols, mask=live, other=0.0).to(tl.float32)
        up = tl.load(x_row + n_cols + cols, mask=live, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        y = (act * up).to(dt).to(tl.float32)
    else:
        y = tl.load(x_row + cols, mask=live, other=0.0).to(tl.float32)
    return y


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, n_rows, n_cols, stride_x, stride_q, QMAX: tl.constexpr,
                       FP8: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Each row's values (_row_values) quantized with the row's scale: one program per row."""
    pdl.wait_then_release(PDL)
    row = tl.program_id(0)
    n_live = tl.where(row < n_rows, n_cols, 0)  # rows past the input (padding for the GEMM) come out as zeros
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = q_ptr + row.to(tl.int64) * stride_q
    if BLOCK >= n_cols:  # the row in registers: read once
        cols = tl.arange(0, BLOCK)
        y = _row_values(x_row, cols, cols < n_live, n_cols, GATED)
        scale = _scale_of(tl.abs(y), QMAX)
        tl.store(q_row + cols, _codes(y, scale, QMAX, FP8), mask=cols < n_cols)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, n_cols, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_row_values(x_row, cols, cols < n_live, n_cols, GATED)))
        scale = _scale_of(amax, QMAX)
        for k0 in range(0, n_cols, BLOCK):  # the row again (from cache; a gated row's values computed again)
            cols = k0 + tl.arange(0, BLOCK)
            y = _row_values(x_row, cols, cols < n_live, n_cols, GATED)
            tl.store(q_row + cols, _codes(y, scale, QMAX, FP8), mask=cols < n_cols)
    tl.store(s_ptr + row, scale)


def _quantize_rows(x: torch.Tensor, n: int, fp8: bool, gated: bool, min_rows: int, block):
    """_quant_rows_kernel over x's rows (n values each): (codes [max(M, min_rows), n], scales)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    q, scale = _codes_buffers(x, n, fp8, min_rows)
    if q.shape[0]:
        block, warps = _block_and_warps(n, block)
        _quant_rows_kernel[(q.shape[0], )](x, q, scale, x.shape[0], n, x.stride(0), q.stride(0),
                                           QMAX=FP8_MAX if fp8 else INT8_MAX, FP8=fp8, GATED=gated, BLOCK=block,
                                           num_warps=warps, PDL=pdl.ON, **pdl.LAUNCH)
    return q, scale


def quantize_per_token(x: torch.Tensor, fp8: bool, min_rows: int = 0, block: int = None):
    """(x_q [max(M, min_rows), K] int8 / e4m3, a_scale float32 [max(M, min_rows), 1]) of x [M, K] (bf16 / fp16 /
    float32); rows past M (``min_rows``: cuda's torch._int_mm wants more than 16) are zeros."""
    return _quantize_rows(x, x.shape[1], fp8, False, min_rows, block)


def _codes_buffers(x2: torch.Tensor, n: int, fp8: bool, min_rows: int):
    rows = max(x2.shape[0], min_rows)
    q = torch.empty((rows, n), dtype=FP8_DTYPE if fp8 else torch.int8, device=x2.device)
    return q, torch.empty((rows, 1), dtype=torch.float32, device=x2.device)


@triton.jit
def _quant_known_amax_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, n_rows, n_cols, stride_x, stride_q,
                             QMAX: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """BLOCK values of a row coded with the scale of its amax (float32 bits as int32: the gated GEMM's)."""
    pdl.wait_then_release(PDL)
    row = tl.program_id(0)
    n_live = tl.where(row < n_rows, n_cols, 0)  # rows past the input (padding for the GEMM) come out as zeros
    amax = tl.load(amax_ptr + tl.minimum(row, n_rows - 1)).to(tl.float32, bitcast=True)
    scale = _scale_from_max(tl.where(row < n_rows, amax, 0.0), QMAX)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < n_live, other=0.0).to(tl.float32)
    tl.store(q_ptr + row.to(tl.int64) * stride_q + cols, _codes(y, scale, QMAX, FP8), mask=cols < n_cols)
    if tl.program_id(1) == 0:
        tl.store(s_ptr + row, scale)


def quantize_with_amax(x: torch.Tensor, amax: torch.Tensor, fp8: bool, min_rows: int = 0, block: int = 1024):
    """quantize_per_token's (x_q, a_scale) of x [M, K] whose rows' max |x| is known (``amax``: int32 [M], the
    float32 bits; kernels/w8a8_gemm.gated_gemm_scaled's): elementwise, many programs a row."""
    q, scale = _codes_buffers(x, x.shape[1], fp8, min_rows)
    if q.shape[0] and x.shape[1]:
        block = min(block, triton.next_power_of_2(x.shape[1]))
        _quant_known_amax_kernel[(q.shape[0], triton.cdiv(x.shape[1], block))](
            x, amax, q, scale, x.shape[0], x.shape[1], x.stride(0), q.stride(0), QMAX=FP8_MAX if fp8 else INT8_MAX,
            FP8=fp8, BLOCK=block, num_warps=4, PDL=pdl.ON, **pdl.LAUNCH)
    return q, scale


@triton.jit
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, n_rows, n_cols, stride_x, stride_r,
                           stride_q, stride_ro, eps, HAS_RES: tl.constexpr, QMAX: tl.constexpr, FP8: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    row = tl.program_id(0)
    # a padding row (past the input: the GEMM's minimum) reads the last row and writes its residual sum again
    # (the same values); its codes are zeros
    src = tl.minimum(row, n_rows - 1).to(tl.int64)
    y, mask = normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, src, stride_x, stride_r, stride_ro, n_cols, eps,
                         HAS_RES, BLOCK)
    y = tl.where(row < n_rows, y.to(tl.float32), 0.0)
    scale = _scale_of(tl.abs(y), QMAX)
    tl.store(q_ptr + row.to(tl.int64) * stride_q + tl.arange(0, BLOCK), _codes(y, scale, QMAX, FP8), mask=mask)
    tl.store(s_ptr + row, scale)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual, fp8: bool, min_rows: int = 0):
    """(x_q [max(M, min_rows), K], a_scale [max(M, min_rows), 1], the residual sum or None): kernels/norm.py's
    rms_norm whose output is quantized per token in the same program (never written in 16 bits)."""
    x2 = x.reshape(-1, x.shape[-1])
    n = x2.shape[-1]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    res2 = x2
    if residual is not None:
        res2 = residual.reshape(-1, n)
        res2 = res2 if res2.stride(-1) == 1 else res2.contiguous()
    res_out = torch.empty_like(x2) if residual is not None else x2
    q, scale = _codes_buffers(x2, n, fp8, min_rows if x2.shape[0] else 0)
    if q.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_quant_kernel[(q.shape[0], )](x2, res2, weight, q, scale, res_out, x2.shape[0], n, x2.stride(0),
                                               res2.stride(0), q.stride(0), res_out.stride(0), eps,
                                               HAS_RES=residual is not None, QMAX=FP8_MAX if fp8 else INT8_MAX,
                                               FP8=fp8, BLOCK=block, num_warps=row_warps(block, q.shape[0]),
                                               PDL=pdl.ON, **pdl.LAUNCH)
    return q, scale, (res_out.view(x.shape) if residual is not None else None)


def silu_and_mul_quant(x: torch.Tensor, fp8: bool, min_rows: int = 0, block: int = None):
    """(x_q [max(T, min_rows), I], a_scale [max(T, min_rows), 1]) of silu(gate) * up, x = cat(gate, up) [T, 2I]:
    kernels/activation.py's values quantized per token, one program per row."""
    return _quantize_rows(x, x.shape[1] // 2, fp8, True, min_rows, block)


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
