"""Scatter the step's K and V into the paged cache (negative slot: skip)."""
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _fill_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh, n_heads,
                    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        m = (h[:, None] < n_heads) & (d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=m)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=m)
        dst = slot * n_heads * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :]
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=m)


def fill_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    t, h, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _fill_kv_kernel[(t, )](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           h, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
                           num_warps=2, PDL=pdl.ON, **pdl.LAUNCH)
