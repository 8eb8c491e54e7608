"""Scatter the step's K and V into the paged cache (negative slot: skip),
alone or together with the rotary embedding of q and k."""
import torch
import triton
import triton.language as tl

from . import pdl
from .limits import no_respecialising
from .rotary import _rotated


@triton.jit(**no_respecialising(pointers=['slot_ptr']))
def _fill_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh, n_heads,
                    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
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


@triton.jit(**no_respecialising(pointers=['slot_ptr']))
def _rotary_fill_kv_kernel(q_ptr, k_ptr, v_ptr, out_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, slot_ptr, stride_qt,
                           stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_ct, n_q, n_kv,
                           HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
                           BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Program (t, j): for j < cdiv(n_q, BLOCK_H), a block of token t's query
    heads is rotated into out[t, :n_q]; the last program rotates t's key
    heads into out[t, n_q:] and writes them and t's values to the cache at
    slot[t] (a negative slot writes no cache)."""
    pdl.wait_then_release(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cos = tl.load(cos_ptr + t * stride_ct + d, mask=dmask, other=0.0)
    sin = tl.load(sin_ptr + t * stride_ct + d, mask=dmask, other=0.0)
    out_row = out_ptr + t * stride_ot
    if j * BLOCK_H < n_q:  # (the branches name their values apart: Triton merges same-named ones)
        qh = j * BLOCK_H + tl.arange(0, BLOCK_H)
        qm = (qh < n_q)[:, None] & dmask[None, :]
        q1, q2 = _rotated(q_ptr + t * stride_qt, stride_qh, qh, d, qm, cos, sin, HALF)
        qbase = out_row + qh[:, None] * HEAD_DIM + d[None, :]
        tl.store(qbase, q1, mask=qm)
        tl.store(qbase + HALF, q2, mask=qm)
    else:
        kh = tl.arange(0, BLOCK_KV)
        kh_valid = kh < n_kv
        km = kh_valid[:, None] & dmask[None, :]
        k1, k2 = _rotated(k_ptr + t * stride_kt, stride_kh, kh, d, km, cos, sin, HALF)
        kbase = out_row + (n_q + kh[:, None]) * HEAD_DIM + d[None, :]
        tl.store(kbase, k1, mask=km)
        tl.store(kbase + HALF, k2, mask=km)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            cbase = slot * n_kv * HEAD_DIM + kh[:, None] * HEAD_DIM
            tl.store(kc_ptr + cbase + d[None, :], k1.to(kc_ptr.dtype.element_ty), mask=km)
            tl.store(kc_ptr + cbase + HALF + d[None, :], k2.to(kc_ptr.dtype.element_ty), mask=km)
            dv = tl.arange(0, BLOCK_D)
            mv = kh_valid[:, None] & (dv < HEAD_DIM)[None, :]
            v = tl.load(v_ptr + t * stride_vt + kh[:, None] * stride_vh + dv[None, :], mask=mv)
            tl.store(vc_ptr + cbase + dv[None, :], v.to(vc_ptr.dtype.element_ty), mask=mv)


def rotary_fill_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """apply_rotary and fill_kv_cache in one launch: the step's q, k and v
    are read once; returns the rotated q and k (views of one buffer)."""
    t, h, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((t, h + hkv, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out[:, :h], out[:, h:]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    block_h = min(16, triton.next_power_of_2(h))
    _rotary_fill_kv_kernel[(t, triton.cdiv(h, block_h) + 1)](
        q, k, v, out, k_cache, v_cache, cos, sin, slot_mapping, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), cos.stride(0), h, hkv, HEAD_DIM=d, BLOCK_H=block_h,
        BLOCK_KV=triton.next_power_of_2(hkv), BLOCK_HALF=triton.next_power_of_2(d // 2),
        BLOCK_D=triton.next_power_of_2(d), num_warps=2, PDL=pdl.ON, **pdl.LAUNCH)
    return out[:, :h], out[:, h:]
