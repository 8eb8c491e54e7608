"""RMSNorm with an optional fused residual add: one program per row."""
import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, stride_ro, n_cols, eps,
               HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """(w * h / rms(h) in x's dtype, the column mask) of one row, h = x (+ residual, stored): the rounding every
    kernel that norms a row shares (this module's; kernels/w8a8_quant.py's, which quantizes it)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # normalise in float32, cast back, then scale (as the reference does)
    return (xf * inv_rms).to(x.dtype) * w, mask


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, n_cols,
                     eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    y, mask = normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, stride_ro, n_cols, eps,
                         HAS_RES, BLOCK)
    tl.store(out_ptr + row * stride_o + tl.arange(0, BLOCK), y, mask=mask)


def row_warps(block: int, rows: int) -> int:
    """Warps of a one-program-per-row norm kernel (this module's RMSNorm, kernels/w8a8_quant.py's RMSNorm with
    its quantization). Rows of 4,096 columns or more take 16 up to 1,024 rows, 8 above. An H200 (session 53,
    4,096 columns with a residual; us per call, 4 / 8 / 16 warps): RMSNorm at 256 rows 2.33 / 2.18 / 2.23, at
    1,024 7.14 / 5.91 / 5.45; RMSNorm + int8 codes at 64 rows 3.73 / 2.99 / 2.51, at 256 4.95 / 4.31 / 3.84, at
    4,096 35.4 / 34.9 / 37.9."""
    if block < 4096:
        return 4
    return 16 if rows <= 1024 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor = None):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n = x2.shape[-1]
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res2 = residual.reshape(-1, n) if residual is not None else x2
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if res2.stride(-1) != 1:
        res2 = res2.contiguous()
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0], )](x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), out.stride(0),
                                      res_out.stride(0), n, eps, HAS_RES=residual is not None, BLOCK=block,
                                      num_warps=row_warps(block, x2.shape[0]), PDL=pdl.ON, **pdl.LAUNCH)
    out = out.view(shape)
    return out, (res_out.view(shape) if residual is not None else None)


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    diff = tl.where(mask, x - mean, 0.0)  # the padding columns stay out of the variance
    rstd = tl.rsqrt(tl.sum(diff * diff, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # statistics and affine in float32, rounded once (as F.layer_norm does)
    tl.store(out_ptr + row * stride_o + cols, (diff * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """DeviceOps.layer_norm: one program per row."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return out.view(shape)
    block = triton.next_power_of_2(x2.shape[-1])
    _layer_norm_kernel[(x2.shape[0], )](x2, weight, bias, out, x2.stride(0), out.stride(0), x2.shape[-1], eps,
                                        BLOCK=block, num_warps=4 if block <= 4096 else 8, PDL=pdl.ON, **pdl.LAUNCH)
    return out.view(shape)
