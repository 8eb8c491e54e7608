"""Scatter the step's K and V into the paged cache (negative slot: skip),
alone or together with the rotary embedding of q and k; quantized as the
cache's policy says (``QUANT`` 8 or 4: lmdeploy/devices/cache.py defines the
codes, the float16 scale and zero per token and head, int4's packing of
elements j and j + D/2 into one byte, and int4's K in the Hadamard basis)."""
import torch
import triton
import triton.language as tl

from ...cache import rotates_k, row_strides
from . import pdl
from .limits import no_respecialising
from .rotary import _rotated


@triton.jit
def _quantized(x1, x2, mask, BITS: tl.constexpr):
    """Each row's (head's) two halves as codes in [0, 2**BITS - 1] (float32), with its scale and zero
    (float16-rounded, as float32): zero = min, scale = (max - min) / (2**BITS - 1), codes rounded."""
    levels: tl.constexpr = (1 << BITS) - 1
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    lo = tl.minimum(tl.min(tl.where(mask, x1, float('inf')), axis=1), tl.min(tl.where(mask, x2, float('inf')), axis=1))
    hi = tl.maximum(tl.max(tl.where(mask, x1, -float('inf')), axis=1),
                    tl.max(tl.where(mask, x2, -float('inf')), axis=1))
    zero = lo.to(tl.float16).to(tl.float32)
    scale = ((hi - lo) / levels).to(tl.float16).to(tl.float32)
    scale = tl.where(scale > 0, scale, 1.0)
    c1 = tl.minimum(tl.maximum(tl.floor((x1 - zero[:, None]) / scale[:, None] + 0.5), 0.0), levels)
    c2 = tl.minimum(tl.maximum(tl.floor((x2 - zero[:, None]) / scale[:, None] + 0.5), 0.0), levels)
    return c1, c2, scale, zero


@triton.jit
def hadamard_dot(x, d):
    """x [rows, D] times the Sylvester-Hadamard signs ``(-1) ** popcount(i & j)`` (i, j in ``d``, D a power of
    two): exact products in x's dtype (tensor cores for 16-bit x), float32 sums. (Rows: at least 16.)"""
    bits = d[:, None] & d[None, :]
    bits = bits ^ (bits >> 8)
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)
    signs = (1 - 2 * (bits & 1)).to(x.dtype)
    if x.dtype == tl.float32:
        y = tl.dot(x, signs, input_precision='ieee')
    else:  # (a float32 dot here ran 20 us in the fill kernel: batch 1 lost 8 %)
        y = tl.dot(x, signs)
    return y


@triton.jit
def _hadamard_halves(x1, x2, d, HSCALE: tl.constexpr):
    """Both halves of ``[x1 x2] @ H`` (H the normalised Sylvester-Hadamard matrix of size 2 HALF, float32):
    H's quarters are the half-size signs S, S, S, -S, so the halves are ``x1 S + x2 S`` and ``x1 S - x2 S``
    times HSCALE."""
    a = hadamard_dot(x1, d)
    b = hadamard_dot(x2, d)
    return (a + b) * HSCALE, (a - b) * HSCALE


@triton.jit
def _write_cache(c_ptr, sz_ptr, row, heads, d, x1, x2, mask, HALF: tl.constexpr, QUANT: tl.constexpr,
                 ROTATE: tl.constexpr = False, HSCALE: tl.constexpr = 1.0, mean_ptr=None, CENTRE: tl.constexpr = False):
    """Store one token's heads (both halves of each) at their ``row`` [H] of the cache (and of its scales:
    :func:`_rows`); ``ROTATE``: quantize them in the Hadamard basis, ``CENTRE``: less the layer's mean key
    ``mean_ptr`` ([n_heads, 2 HALF] float32, in that basis) (int4's K, devices/cache.py)."""
    if ROTATE:
        x1, x2 = _hadamard_halves(x1, x2, d, HSCALE)
    if CENTRE:
        mean = mean_ptr + heads[:, None] * (2 * HALF) + d[None, :]
        x1 = x1.to(tl.float32) - tl.load(mean, mask=mask, other=0.0)
        x2 = x2.to(tl.float32) - tl.load(mean + HALF, mask=mask, other=0.0)
    if QUANT == 0:
        base = c_ptr + row[:, None] * (2 * HALF) + d[None, :]
        tl.store(base, x1.to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(base + HALF, x2.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        c1, c2, scale, zero = _quantized(x1, x2, mask, QUANT)
        if QUANT == 8:
            base = c_ptr + row[:, None] * (2 * HALF) + d[None, :]
            tl.store(base, c1.to(tl.uint8), mask=mask)
            tl.store(base + HALF, c2.to(tl.uint8), mask=mask)
        else:  # element j in the low four bits of byte j, element j + HALF in its high four
            tl.store(c_ptr + row[:, None] * HALF + d[None, :], c1.to(tl.uint8) | (c2.to(tl.uint8) << 4), mask=mask)
        h_valid = tl.max(mask.to(tl.int32), axis=1) > 0
        tl.store(sz_ptr + row * 2, scale.to(tl.float16), mask=h_valid)
        tl.store(sz_ptr + row * 2 + 1, zero.to(tl.float16), mask=h_valid)


@triton.jit
def _rows(slot, heads, block_size, row_block, row_slot, row_head):
    """The cache rows (of a head's codes, or of its scale and zero) of a slot's heads: the layout's strides
    (devices/cache.py; token- or head-major blocks) in rows."""
    blk = slot // block_size
    return blk * row_block + (slot - blk * block_size) * row_slot + heads * row_head


@triton.jit(**no_respecialising(pointers=['slot_ptr']))
def _fill_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, kmean_ptr, slot_ptr, stride_kt, stride_kh,
                    stride_vt, stride_vh, n_heads, block_size, row_block, row_slot, row_head, HALF: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, QUANT: tl.constexpr, ROTATE: tl.constexpr,
                    HSCALE: tl.constexpr, CENTRE: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_HALF)
        m = (h[:, None] < n_heads) & (d[None, :] < HALF)
        kb = k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :]
        vb = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
        row = _rows(slot, h, block_size, row_block, row_slot, row_head)
        _write_cache(kc_ptr, ksz_ptr, row, h, d, tl.load(kb, mask=m, other=0.0), tl.load(kb + HALF, mask=m, other=0.0),
                     m, HALF, QUANT, ROTATE, HSCALE, kmean_ptr, CENTRE)
        _write_cache(vc_ptr, vsz_ptr, row, h, d, tl.load(vb, mask=m), tl.load(vb + HALF, mask=m), m, HALF, QUANT)


def quant_of(cache_tensor, head_dim: int, scale_zero) -> int:
    """The policy a cache's tensors say: none without scales, int8 with a byte per element, else int4."""
    if scale_zero is None:
        return 0
    return 8 if cache_tensor.shape[-1] == head_dim else 4


def _heads_block(n: int, rotate: bool) -> int:
    """Rows of a program's head block: a power of two, and at least a dot's 16 where K is rotated."""
    return max(16 if rotate else 1, triton.next_power_of_2(n))


def fill_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale_zero=None, v_scale_zero=None, k_mean=None,
                  rows=None):
    """``k_mean``: [Hkv, D] float32 taken off each key (in the basis it is stored in) before quantizing;
    ``rows``: the caches' :func:`row_strides` (``KVCache.rows``), else worked out here."""
    t, h, d = k.shape
    if t == 0:
        return
    assert d % 2 == 0, 'head_dim must be even'
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    quant = quant_of(k_cache, d, k_scale_zero)
    rotate = rotates_k(quant, d)
    _fill_kv_kernel[(t, )](k, v, k_cache, v_cache, k_scale_zero if quant else k_cache,
                           v_scale_zero if quant else v_cache, _mean_arg(k_mean, k_cache), slot_mapping,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1), h, k_cache.shape[1],
                           *(rows or row_strides(k_cache, v_cache, k_scale_zero, v_scale_zero)), HALF=d // 2,
                           BLOCK_H=_heads_block(h, rotate), BLOCK_HALF=triton.next_power_of_2(d // 2), QUANT=quant,
                           ROTATE=rotate, HSCALE=d**-0.5, CENTRE=_centres(quant, k_mean), num_warps=2, PDL=pdl.ON,
                           **pdl.LAUNCH)


def _centres(quant: int, k_mean) -> bool:
    return bool(quant) and k_mean is not None


def _mean_arg(k_mean, stand_in):
    """The layer's mean key, or for a cache without one another tensor in its place (unread)."""
    return k_mean if k_mean is not None else stand_in


@triton.jit(**no_respecialising(pointers=['slot_ptr']))
def _rotary_fill_kv_kernel(q_ptr, k_ptr, v_ptr, out_ptr, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, kmean_ptr, cos_ptr, sin_ptr,
                           slot_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                           stride_ct, n_q, n_kv, block_size, row_block, row_slot, row_head, HEAD_DIM: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                           QUANT: tl.constexpr, ROTATE: tl.constexpr, HSCALE: tl.constexpr, CENTRE: tl.constexpr,
                           PDL: tl.constexpr):
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
            row = _rows(slot, kh, block_size, row_block, row_slot, row_head)
            _write_cache(kc_ptr, ksz_ptr, row, kh, d, k1, k2, km, HALF, QUANT, ROTATE, HSCALE, kmean_ptr, CENTRE)
            vb = v_ptr + t * stride_vt + kh[:, None] * stride_vh + d[None, :]
            _write_cache(vc_ptr, vsz_ptr, row, kh, d, tl.load(vb, mask=km), tl.load(vb + HALF, mask=km), km, HALF,
                         QUANT)


def rotary_fill_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale_zero=None, v_scale_zero=None,
                   k_mean=None, rows=None):
    """apply_rotary and fill_kv_cache in one launch: the step's q, k and v
    are read once (and K/V quantized there when the cache is); returns the
    rotated q and k (views of one buffer). ``rows`` as fill_kv_cache's."""
    t, h, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((t, h + hkv, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out[:, :h], out[:, h:]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    block_h = min(16, triton.next_power_of_2(h))
    quant = quant_of(k_cache, d, k_scale_zero)
    rotate = rotates_k(quant, d)
    _rotary_fill_kv_kernel[(t, triton.cdiv(h, block_h) + 1)](
        q, k, v, out, k_cache, v_cache, k_scale_zero if quant else k_cache, v_scale_zero if quant else v_cache,
        _mean_arg(k_mean, cos), cos, sin, slot_mapping, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), out.stride(0), cos.stride(0), h, hkv, k_cache.shape[1],
        *(rows or row_strides(k_cache, v_cache, k_scale_zero, v_scale_zero)), HEAD_DIM=d,
        BLOCK_H=block_h, BLOCK_KV=_heads_block(hkv, rotate), BLOCK_HALF=triton.next_power_of_2(d // 2), QUANT=quant,
        ROTATE=rotate, HSCALE=d**-0.5, CENTRE=_centres(quant, k_mean), num_warps=2, PDL=pdl.ON, **pdl.LAUNCH)
    return out[:, :h], out[:, h:]
