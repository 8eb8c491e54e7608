"""Rotary embedding ("rotate half" layout), q and k in one launch each."""
import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _rotated(x_ptr, stride_h, heads, d, mask, cos, sin, HALF: tl.constexpr):
    """Rotate-half of the heads ``heads`` of one token (x_ptr points at the
    token): returns both halves in x's dtype, rounded after every product
    and sum as x * cos + rotate_half(x) * sin does in x's dtype (the
    reference, and transformers)."""
    base = x_ptr + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    c = cos.to(dt).to(tl.float32)[None, :]
    s = sin.to(dt).to(tl.float32)[None, :]
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (x1f * c).to(dt).to(tl.float32) + (-x2f * s).to(dt).to(tl.float32)
    o2 = (x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt)


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ot, stride_oh, stride_ct, n_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    m = (heads < n_heads)[:, None] & dmask[None, :]
    cos = tl.load(cos_ptr + t * stride_ct + d, mask=dmask, other=0.0)
    sin = tl.load(sin_ptr + t * stride_ct + d, mask=dmask, other=0.0)
    o1, o2 = _rotated(x_ptr + t * stride_xt, stride_xh, heads, d, m, cos, sin, HALF)
    obase = out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(obase, o1, mask=m)
    tl.store(obase + HALF, o2, mask=m)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, h, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    half = d // 2
    block_h = min(16, triton.next_power_of_2(h))
    _rotary_kernel[(t, triton.cdiv(h, block_h))](x, out, cos, sin, x.stride(0), x.stride(1), out.stride(0),
                                                 out.stride(1), cos.stride(0), h, HALF=half, BLOCK_H=block_h,
                                                 BLOCK_D=triton.next_power_of_2(half), num_warps=2, PDL=pdl.ON,
                                                 **pdl.LAUNCH)
    return out


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether k's heads follow q's in memory with the same strides (both
    are views of one fused qkv projection): then one launch rotates both."""
    return (q.dtype == k.dtype and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2] and q.stride() == k.stride()
            and q.stride(2) == 1 and q.stride(1) == q.shape[2]
            and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size())


def apply_rotary(q, k, cos, sin):
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    if _adjacent(q, k):
        h = q.shape[1]
        both = q.as_strided((q.shape[0], h + k.shape[1], q.shape[2]), q.stride())
        out = _rotate(both, cos, sin)
        return out[:, :h], out[:, h:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
