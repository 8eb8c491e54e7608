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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, two_i = x.shape
    n = two_i // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block,
                                                         num_warps=4, PDL=pdl.ON, **pdl.LAUNCH)
    return out
