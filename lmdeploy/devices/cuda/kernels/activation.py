import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # silu rounded to the activation dtype before the product, as silu(gate) * up does
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dt), mask=mask)


def _gated(kernel, x: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for x = cat(gate, up) [T, 2I], one program per row and column block."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, two_i = x.shape
    n = two_i // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4,
                                          PDL=pdl.ON, **pdl.LAUNCH)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated(_silu_and_mul_kernel, x)


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))); tanh(z) = 1 - 2 / (exp(2z) + 1), which
    # saturates to +-1 without overflow (exp -> inf gives 1, exp -> 0 gives -1)
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    # rounded to the activation dtype before the product, as F.gelu(gate, approximate='tanh') * up does
    act = (0.5 * gate * (1.0 + tanh)).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dt), mask=mask)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for x = cat(gate, up) [T, 2I] (DeviceOps.gelu_tanh_and_mul)."""
    return _gated(_gelu_tanh_and_mul_kernel, x)


@triton.jit
def _gelu_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, TANH: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if TANH:  # as _gelu_tanh_and_mul_kernel: tanh(z) = 1 - 2 / (exp(2z) + 1)
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:  # x * Phi(x), Phi through erf
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gelu(x: torch.Tensor, approximate: str = 'none') -> torch.Tensor:
    """DeviceOps.gelu on [T, I]: one program per row and column block, in float32, rounded once."""
    if approximate not in ('none', 'tanh'):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, n = x2.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _gelu_kernel[(rows, triton.cdiv(n, block))](x2, out, x2.stride(0), out.stride(0), n,
                                                     TANH=approximate == 'tanh', BLOCK=block, num_warps=4,
                                                     PDL=pdl.ON, **pdl.LAUNCH)
    return out.view(shape)
