"""Paged attention: flash-attention prefill and split-context (flash-decoding) decode.

Both read K/V through the block tables, token by token, so any block size
works and the context may hold earlier blocks (prefix cache, chunked
prefill). Softmax is online, in float32, with exp2. A quantized cache
(``QUANT`` 8 or 4) enters the dots as its integer codes (float16, made
from the bytes by ``_codes``), its per-token scales and zeros applied to
the dots' results (``_attend_tile``); q is rotated into K's basis where
int4 stores K rotated (``_scales``).
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from ...cache import rotates_k
from ..splits import MAX_DECODE_SPLITS, min_slice_tokens, num_decode_splits  # noqa: F401 (tests read them here)
from . import pdl
from .kv_cache import hadamard_dot, quant_of
from .limits import no_respecialising, shared_memory, tensor_core_dots

_LOG2E = 1.4426950408889634


def _codes_ptx(pick: str) -> tl.constexpr:
    """PTX turning four bytes ($2) into four float16 codes ($0, $1): ``pick`` leaves in t the bits to convert,
    two byte permutes set them under float16 1024's exponent, two packed subtractions take 1024 off."""
    return tl.constexpr('{ .reg .b32 m, c, t; mov.b32 m, 0x64646464; mov.b32 c, 0x64006400; ' + pick +
                        ' prmt.b32 $0, t, m, 0x4140; prmt.b32 $1, t, m, 0x4342; '
                        'sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c; }')


_PTX_BYTE = _codes_ptx('mov.b32 t, $2;')
_PTX_LOW = _codes_ptx('and.b32 t, $2, 0x0F0F0F0F;')
_PTX_HIGH = _codes_ptx('shr.b32 t, $2, 4; and.b32 t, t, 0x0F0F0F0F;')


@triton.jit
def _ptx_codes(x, PTX: tl.constexpr):
    return tl.inline_asm_elementwise(PTX, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _codes(x, PART: tl.constexpr, dtype: tl.constexpr, ASM: tl.constexpr):
    """A uint8 tile's codes in ``dtype`` (float16 for 16-bit models, or float32; exact): each byte (PART 0),
    or its low (1) or high (2) four bits.

    On a GPU (``ASM``) by inline PTX, four bytes at a time: one byte permute
    sets two codes under float16 1024's exponent (bits 0x64cc are 1024 + cc),
    one packed subtraction takes 1024 off both. Integer-to-float conversions
    run at a quarter of the rate of these (H100, int8, batch 256, 1k context:
    384 us a call with conversions, 352 with permutes, bf16 356)."""
    if ASM and dtype == tl.float16:
        if PART == 0:
            y = _ptx_codes(x, _PTX_BYTE)
        elif PART == 1:
            y = _ptx_codes(x, _PTX_LOW)
        else:
            y = _ptx_codes(x, _PTX_HIGH)
    else:  # (the interpreter runs no PTX)
        if PART == 0:
            y = x.to(dtype)
        elif PART == 1:
            y = (x & 0xF).to(dtype)
        else:
            y = (x >> 4).to(dtype)
    return y


@triton.jit
def _load_query(base, row_valid, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
                QUANT: tl.constexpr):
    """Query rows (``base``: each row's first element) as the dots take them, with each row's sum (what a
    quantized cache's zero points multiply): the rows in their dtype (``QUANT`` 0), or as their two halves
    in the codes' dtype (float16, float32 for a float32 model). Returns (q or its first half, its second
    half or q again, row sums)."""
    DOT: tl.constexpr = tl.float32 if base.dtype.element_ty == tl.float32 else tl.float16
    if QUANT != 0:
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_h = tl.arange(0, BLOCK_HALF)
        m = row_valid[:, None] & (offs_h < HALF)[None, :]
        q1 = tl.load(base[:, None] + offs_h[None, :], mask=m, other=0.0)
        q2 = tl.load(base[:, None] + HALF + offs_h[None, :], mask=m, other=0.0)
        q1 = q1.to(DOT)
        q2 = q2.to(DOT)
        q_sum = tl.sum(q1.to(tl.float32), axis=1) + tl.sum(q2.to(tl.float32), axis=1)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        q1 = tl.load(base[:, None] + offs_d[None, :], mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :],
                     other=0.0)
        q2 = q1
        q_sum = tl.sum(q1.to(tl.float32), axis=1)
    return q1, q2, q_sum


@triton.jit
def _store_rows(base, acc, acc2, l_i, row_valid, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_HALF: tl.constexpr, QUANT: tl.constexpr):
    """acc / l (0 for a row that saw nothing) to rows ``base`` in their dtype; a quantized cache's two
    halves apart."""
    if QUANT != 0:
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_h = tl.arange(0, BLOCK_HALF)
        m = row_valid[:, None] & (offs_h < HALF)[None, :]
        out1 = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
        out2 = tl.where(l_i[:, None] > 0, acc2 / l_i[:, None], 0.0)
        tl.store(base[:, None] + offs_h[None, :], out1.to(base.dtype.element_ty), mask=m)
        tl.store(base[:, None] + HALF + offs_h[None, :], out2.to(base.dtype.element_ty), mask=m)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
        tl.store(base[:, None] + offs_d[None, :], out.to(base.dtype.element_ty),
                 mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _softcap(x):
    """tanh(x), from one exp2 of -2|x| (no overflow; the interpreter and every GPU have exp2)."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _mean_shift(q, q2, mean_ptr, kvh, HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, CENTRED: tl.constexpr):
    """q . m per query row, m the KV head's mean key that int4 takes off K (devices/cache.py): what a
    soft-capped score must get back (tanh is not blind to a shift of every score, softmax is); 0 otherwise."""
    if CENTRED:
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_h = tl.arange(0, BLOCK_HALF)
        m = offs_h < HALF
        m1 = tl.load(mean_ptr + kvh * HEAD_DIM + offs_h, mask=m, other=0.0).to(tl.float32)
        m2 = tl.load(mean_ptr + kvh * HEAD_DIM + HALF + offs_h, mask=m, other=0.0).to(tl.float32)
        shift = tl.sum(q.to(tl.float32) * m1[None, :], axis=1) + tl.sum(q2.to(tl.float32) * m2[None, :], axis=1)
    else:
        shift = tl.sum(q.to(tl.float32), axis=1) * 0.0
    return shift


@triton.jit
def _load_scale_zero(sz_ptr, page, in_block, kvh, n_valid, stride_zn, stride_zs, stride_zh):
    """Each token's (scale, zero) as float32 [tokens] (0 where masked)."""
    zoff = page * stride_zn + in_block * stride_zs + kvh * stride_zh
    scale = tl.load(sz_ptr + zoff, mask=n_valid, other=0.0).to(tl.float32)
    zero = tl.load(sz_ptr + zoff + 1, mask=n_valid, other=0.0).to(tl.float32)
    return scale, zero


@triton.jit
def _attend_tile(q, q2, q_sum, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, page, in_block, n_valid, allowed, kvh, m_i, l_i,
                 acc, acc2, scale_log2, stride_cn, stride_cs, stride_ch, stride_zn, stride_zs, stride_zh,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, QUANT: tl.constexpr,
                 ASM: tl.constexpr, MASKED: tl.constexpr = True, softcap_log2=0.0, q_shift=0.0,
                 SOFTCAP: tl.constexpr = False, EMPTY_ROWS: tl.constexpr = False, bias=0.0,
                 ALIBI: tl.constexpr = False):
    """Fold one tile of context tokens into the online softmax: gather K/V
    through the block table, score, rescale the running max/sum/output.

    A quantized cache is never dequantized element by element: with
    ``k = c * scale + zero`` per token, ``q . k = scale * (q . c) + zero *
    sum(q)`` (``q_sum``), and ``p @ v = (p * scale) @ c + p @ zero``; the
    dots take the integer codes as they are (exact in float16). Quantized
    caches work in halves of the head (``q2``, ``acc2``): int4's byte holds
    element j in its low four bits and j + D/2 in its high four, so each
    byte is loaded once and feeds two dots; int8 keeps the same tile shapes
    (H100, batch 64, 4k context: one 128-byte-wide tile 451 us a call, two
    64-byte-wide ones 301; bf16 376).

    ``page``/``in_block``: each token's cache block and place in it (``page``
    may be one block for the whole tile). Without ``MASKED`` every token of
    the tile is valid and visible to every query row (the tiles below a
    causal prefill's diagonal): no masks, no select.

    ``SOFTCAP``: scores c tanh(s / c), ``scale_log2`` then being scale / c and
    ``softcap_log2`` c log2(e) (``q_shift``: int4's mean key back first).
    ``EMPTY_ROWS``: a row may have seen no token yet (a sliding window's
    first tile), whose running max stays -inf without making NaN. ``ALIBI``:
    ``bias`` [rows, tokens] (log2 domain, _alibi_bias) added to the scores."""
    off = page * stride_cn + in_block * stride_cs + kvh * stride_ch
    if QUANT != 0:
        offs_c = tl.arange(0, BLOCK_HALF)
        c_valid = offs_c < HEAD_DIM // 2
    else:
        offs_c = tl.arange(0, BLOCK_D)
        c_valid = offs_c < HEAD_DIM
    kv_other = 0
    if MASKED:
        kv_mask = n_valid[:, None] & c_valid[None, :]
    elif BLOCK_D != HEAD_DIM:
        kv_mask = c_valid[None, :]
    else:
        kv_mask = None
        kv_other = None
    k = tl.load(kc_ptr + off[:, None] + offs_c[None, :], mask=kv_mask, other=kv_other)
    if QUANT == 0:
        s = tl.dot(q, tl.trans(k))
    else:
        if QUANT == 8:
            k2 = tl.load(kc_ptr + off[:, None] + HEAD_DIM // 2 + offs_c[None, :], mask=kv_mask, other=kv_other)
            s = tl.dot(q, tl.trans(_codes(k, 0, q.dtype, ASM)))
            s = tl.dot(q2, tl.trans(_codes(k2, 0, q.dtype, ASM)), s)
        else:
            s = tl.dot(q, tl.trans(_codes(k, 1, q.dtype, ASM)))
            s = tl.dot(q2, tl.trans(_codes(k, 2, q.dtype, ASM)), s)
        k_scale, k_zero = _load_scale_zero(ksz_ptr, page, in_block, kvh, n_valid, stride_zn, stride_zs, stride_zh)
        s = s * k_scale[None, :] + q_sum[:, None] * k_zero[None, :]
    if SOFTCAP:
        s = _softcap((s + q_shift[:, None]) * scale_log2) * softcap_log2
    else:
        s = s * scale_log2
    if ALIBI:
        s = s + bias
    if MASKED:
        s = tl.where(allowed, s, float('-inf'))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if EMPTY_ROWS:
        m_use = tl.where(m_new > float('-inf'), m_new, 0.0)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
    else:
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(vc_ptr + off[:, None] + offs_c[None, :], mask=kv_mask, other=kv_other)
    if QUANT == 0:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        v_scale, v_zero = _load_scale_zero(vsz_ptr, page, in_block, kvh, n_valid, stride_zn, stride_zs, stride_zh)
        pv = (p * v_scale[None, :]).to(q.dtype)
        pz = tl.sum(p * v_zero[None, :], axis=1)[:, None]
        if QUANT == 8:
            v2 = tl.load(vc_ptr + off[:, None] + HEAD_DIM // 2 + offs_c[None, :], mask=kv_mask, other=kv_other)
            acc = tl.dot(pv, _codes(v, 0, q.dtype, ASM), acc * alpha[:, None]) + pz
            acc2 = tl.dot(pv, _codes(v2, 0, q.dtype, ASM), acc2 * alpha[:, None]) + pz
        else:
            acc = tl.dot(pv, _codes(v, 1, q.dtype, ASM), acc * alpha[:, None]) + pz
            acc2 = tl.dot(pv, _codes(v, 2, q.dtype, ASM), acc2 * alpha[:, None]) + pz
    return m_new, l_i, acc, acc2


@triton.jit
def _alibi_bias(slope, offs_n, q_pos):
    """ALiBi's [rows, tokens] score bias slope * (j - p), log2 domain (``slope``: [rows], times log2 e)."""
    return slope[:, None] * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)


@triton.jit
def _tile_pages(table, start_n, n_valid, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache block of each token of the tile at ``start_n`` (a multiple of ``BLOCK_N``) and its place
    there: one block-table load where the tile lies inside one block."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if BLOCK_SIZE % BLOCK_N == 0:
        page = tl.load(table + start_n // BLOCK_SIZE).to(tl.int64)
    else:
        page = tl.load(table + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
    return page, offs_n % BLOCK_SIZE


@triton.jit(**no_respecialising(ints=['stride_bt', 'window'], pointers=['tables_ptr', 'q_start_ptr', 'q_lens_ptr',
                                                                        'kv_lens_ptr']))
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, out_ptr, tables_ptr, q_start_ptr, q_lens_ptr, kv_lens_ptr,
                    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_cn, stride_cs, stride_ch, stride_zn,
                    stride_zs, stride_zh, stride_bt, num_heads, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, QUANT: tl.constexpr, ASM: tl.constexpr, PACK: tl.constexpr = False,
                    window=0, softcap_log2=0.0, mean_ptr=None, SLIDING: tl.constexpr = False,
                    SOFTCAP: tl.constexpr = False, CENTRED: tl.constexpr = False, alibi_ptr=None,
                    ALIBI: tl.constexpr = False):
    """One program: BLOCK_M query rows of one head of sequence ``b`` (with
    ``PACK``: BLOCK_M / GROUP tokens of each of the GROUP heads of one KV
    head, row r being token r // GROUP of head r % GROUP, so that each K/V
    tile loaded serves them all). The grid runs heads fastest (the GROUP
    heads of a KV head read its tiles from L2 together) and query blocks
    last to first: a causal block's work grows with its position, so the
    heaviest start first and the light ones fill the tail. The context
    below the block's first row is attended without masks; only the tiles
    that reach the diagonal (or the context's end) take them. ``SLIDING``:
    row p sees positions above p - ``window`` only; tiles below every
    row's window are skipped, those some row's window starts in masked.
    ``SOFTCAP``: soft-capped scores (_attend_tile). ``ALIBI``: each head's
    slope at ``alibi_ptr`` (times log2 e), position biases (_alibi_bias)."""
    BLOCK_T: tl.constexpr = BLOCK_M // GROUP if PACK else BLOCK_M  # query tokens a program takes
    b = tl.program_id(1)
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_len = tl.load(q_lens_ptr + b).to(tl.int32)
    if m_block * BLOCK_T < q_len:
        kv_len = tl.load(kv_lens_ptr + b).to(tl.int32)
        q_start = tl.load(q_start_ptr + b).to(tl.int64)
        if PACK:
            kvh = tl.program_id(0)
            rows = tl.arange(0, BLOCK_M)
            offs_m = m_block * BLOCK_T + rows // GROUP
            h = kvh * GROUP + rows % GROUP
        else:
            h = tl.program_id(0)
            kvh = h // GROUP
            offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = offs_m < q_len
        q_pos = kv_len - q_len + offs_m
        q, q2, q_sum = _load_query(q_ptr + (q_start + offs_m) * stride_qt + h * stride_qh, m_valid, HEAD_DIM,
                                   BLOCK_D, BLOCK_HALF, QUANT)
        m_i = tl.full([BLOCK_M], float('-inf'), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_HALF if QUANT != 0 else BLOCK_D], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_HALF if QUANT != 0 else 1], dtype=tl.float32)
        # causal: this block's last query sees up to its own position, its first one everything before
        # ``open_end``
        first_pos = kv_len - q_len + m_block * BLOCK_T
        kv_end = tl.minimum(kv_len, first_pos + BLOCK_T)
        open_end = (first_pos + 1) // BLOCK_N * BLOCK_N
        table = tables_ptr + b.to(tl.int64) * stride_bt
        all_valid = tl.full([BLOCK_N], 1, tl.int1)
        q_shift = _mean_shift(q, q2, mean_ptr, kvh, HEAD_DIM, BLOCK_HALF, CENTRED) if SOFTCAP else 0.0
        slope = tl.load(alibi_ptr + (h + tl.zeros([BLOCK_M], dtype=tl.int32))) if ALIBI else 0.0
        open_start = 0
        if SLIDING:
            # from the tile of the first row's window start; every row sees all of a tile from the last row's
            open_start = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
            full = tl.minimum(tl.cdiv(tl.maximum(first_pos + BLOCK_T - window, 0), BLOCK_N) * BLOCK_N, open_end)
            for start_n in range(open_start, full, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                n_valid = offs_n > first_pos - window  # (what no row sees is not read: its block may be gone)
                allowed = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window)
                page, in_block = _tile_pages(table, start_n, n_valid, BLOCK_SIZE, BLOCK_N)
                bias = _alibi_bias(slope, offs_n, q_pos) if ALIBI else 0.0
                m_i, l_i, acc, acc2 = _attend_tile(q, q2, q_sum, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, page, in_block,
                                                   n_valid, allowed, kvh, m_i, l_i, acc, acc2, scale_log2,
                                                   stride_cn, stride_cs, stride_ch, stride_zn, stride_zs, stride_zh,
                                                   HEAD_DIM, BLOCK_D, BLOCK_HALF, QUANT, ASM, True, softcap_log2,
                                                   q_shift, SOFTCAP, True, bias, ALIBI)
            open_start = full
        for start_n in range(open_start, open_end, BLOCK_N):
            page, in_block = _tile_pages(table, start_n, all_valid, BLOCK_SIZE, BLOCK_N)
            bias = _alibi_bias(slope, start_n + tl.arange(0, BLOCK_N), q_pos) if ALIBI else 0.0
            m_i, l_i, acc, acc2 = _attend_tile(q, q2, q_sum, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, page, in_block,
                                               all_valid, None, kvh, m_i, l_i, acc, acc2, scale_log2, stride_cn,
                                               stride_cs, stride_ch, stride_zn, stride_zs, stride_zh, HEAD_DIM,
                                               BLOCK_D, BLOCK_HALF, QUANT, ASM, False, softcap_log2, q_shift, SOFTCAP,
                                               SLIDING, bias, ALIBI)
        for start_n in range(open_end, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_valid = offs_n < kv_end
            if SLIDING:
                n_valid = n_valid & (offs_n > first_pos - window)
            allowed = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
            if SLIDING:
                allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
            page, in_block = _tile_pages(table, start_n, n_valid, BLOCK_SIZE, BLOCK_N)
            bias = _alibi_bias(slope, offs_n, q_pos) if ALIBI else 0.0
            m_i, l_i, acc, acc2 = _attend_tile(q, q2, q_sum, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, page, in_block,
                                               n_valid, allowed, kvh, m_i, l_i, acc, acc2, scale_log2, stride_cn,
                                               stride_cs, stride_ch, stride_zn, stride_zs, stride_zh, HEAD_DIM,
                                               BLOCK_D, BLOCK_HALF, QUANT, ASM, True, softcap_log2, q_shift, SOFTCAP,
                                               SLIDING, bias, ALIBI)
        _store_rows(out_ptr + (q_start + offs_m) * stride_ot + h * stride_oh, acc, acc2, l_i, m_valid, HEAD_DIM,
                    BLOCK_D, BLOCK_HALF, QUANT)


def _packs(group: int, block_m: int = 128) -> bool:
    """Whether ``group`` query heads a KV head can share a program's ``block_m`` rows: a power of two above
    one that divides them."""
    return 1 < group and group & (group - 1) == 0 and block_m % group == 0


def prefill_tiles(block_d: int, max_q_len: int = 0, group: int = 1, quant: int = 0, smem_bytes: int = 227 * 1024,
                  tensor_cores: bool = True):
    """(query rows, context tokens) a program's tile holds, warps, stages, heads packed.

    A 16-bit cache with grouped heads (``group`` query heads a KV head, a
    power of two) packs a KV head's query heads into one program's rows:
    each K/V tile loaded then feeds them all, and the causal diagonal is
    cut at rows / group tokens. 128 rows for long prompts, 64 for short,
    32-token context tiles (H100, head_dim 128, GQA 4, bf16,
    benchmark/prefill_attn_sweep.py --pack yes, against the unpacked tiles
    below: three 3,000-token prompts 538.2 -> 505.3 us, the next step's
    chunk after context 599.4 -> 587.1, one 8,000-token prompt 1,381 ->
    1,325, a refill step of 24 prompts of ~200 tokens 84.6 -> 70.9). Else
    each query head runs in its own programs: 64-token context tiles for
    long prompts, 32 for short ones (same bench: three 3,000-token prompts
    562.6 -> 533.5 us, one 8,000-token prompt 1,477 -> 1,363; the refill
    step 84.2 -> 95.6). A quantized cache packs 64 rows with 128-token
    context tiles for long prompts, 64 for short (its dots take the codes
    in two halves: more registers a row; same bench, --policy 8 / 4 against
    its tiles with heads apart: three 3,000-token prompts 1.21x / 1.24x,
    the chunk after context 1.22x / 1.24x, one 8,000-token prompt 1.24x /
    1.30x, the refill step 1.45x / 1.09x). Where 96 KB of shared memory do
    not fit (Turing), packed tiles keep 64 rows and 64-token context tiles;
    and so on GPUs whose dots Triton runs without tensor cores
    (``tensor_cores`` False: Volta; limits.tensor_core_dots), where the long
    prompts' tiles were never measured and their FMA loops took 3-6 times
    as long to compile (60-100 s each on sm70 with a quantized cache or a
    window and soft cap, against 15-20 s for the short ones).
    Heads 256 wide (Gemma 2: 2 query heads a KV head, soft cap 50) pack
    too, a 16-bit cache only: 128 rows with 64-token context tiles and 8
    warps for long prompts (192 KB of shared memory), 64 rows with 32 and
    4 warps for short ones (H200, same bench, --heads 16 8 256 --softcap 50
    --pack both, against 32-row tiles with heads apart: three 3,000-token
    prompts 1,519 -> 562 us, a refill step of 2,330 tokens 73.3 -> 42.6).
    A CUDA graph recorded for n tokens keeps the tiles of ``max_q_len`` n."""
    if block_d <= 128 and group <= 8 and _packs(group):
        long = max_q_len >= 1024 and smem_bytes >= 96 * 1024 and tensor_cores
        if quant:
            return 64, (128 if long else 64), 4, 2, True
        return (128 if long else 64), 32, 4, 2, True
    if block_d > 128 and not quant and group <= 8 and _packs(group) and smem_bytes >= 100 * 1024:
        if max_q_len >= 1024 and smem_bytes >= 200 * 1024:
            return 128, 64, 8, 2, True
        return 64, 32, 4, 2, True
    wide = block_d <= 64 or block_d <= 128 and max_q_len >= 1024
    return (64 if block_d <= 128 else 32), (64 if wide else 32), 4, 2, False


def _scales(q, k_cache, v_cache, k_scale_zero, v_scale_zero):
    """(q as the kernels take it, K scale/zero, V scale/zero, their strides, the policy's compile-time
    arguments): the cache tensors themselves stand in for the scales of an unquantized cache (a pointer of
    another type would be another compiled variant). Where int4 stores K rotated (devices/cache.py) q is
    rotated here, into float16 (float32 for a float32 model): more bits than bfloat16 keeps, and the
    kernels' dots take the codes in float16."""
    d = q.shape[-1]
    quant = quant_of(k_cache, d, k_scale_zero)
    consts = dict(QUANT=quant, BLOCK_HALF=triton.next_power_of_2(d // 2), ASM=k_cache.device.type == 'cuda')
    if not quant:
        return q, k_cache, v_cache, (0, 0, 0), consts
    if rotates_k(quant, d):
        q = _rotate_query(q)
    return q, k_scale_zero, v_scale_zero, k_scale_zero.stride()[:3], consts


@triton.jit
def _rotate_query_kernel(q_ptr, out_ptr, rows, stride_qt, stride_qh, num_heads, HEAD_DIM: tl.constexpr,
                         BLOCK_R: tl.constexpr, HSCALE: tl.constexpr):
    """Query rows (token r // num_heads, head r % num_heads) times the normalised Hadamard matrix
    (devices/cache.py): a dot with its signs, exact in q's dtype, times HSCALE; out is [rows, HEAD_DIM]."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, HEAD_DIM)
    valid = (r < rows)[:, None]
    src = (r // num_heads).to(tl.int64) * stride_qt + (r % num_heads) * stride_qh
    q = tl.load(q_ptr + src[:, None] + d[None, :], mask=valid, other=0.0)
    y = hadamard_dot(q, d)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * HEAD_DIM + d[None, :], (y * HSCALE).to(out_ptr.dtype.element_ty),
             mask=valid)


def _rotate_query(q: torch.Tensor) -> torch.Tensor:
    t, h, d = q.shape
    out = torch.empty((t, h, d), dtype=torch.float32 if q.dtype == torch.float32 else torch.float16, device=q.device)
    if t == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_r = 64 if d <= 128 else 32
    _rotate_query_kernel[(triton.cdiv(t * h, block_r), )](q, out, t * h, q.stride(0), q.stride(1), h, HEAD_DIM=d,
                                                         BLOCK_R=block_r, HSCALE=d**-0.5, num_warps=4)
    return out


def _variant(scale: float, sliding_window, logit_softcap, k_mean, alibi_slopes=None):
    """(the scores' factor, the kernels' window, soft-cap and ALiBi arguments): none without them, so the
    default kernels compile as they did. A soft-capped score is c tanh(scale s / c) (log2 domain: the
    factor scale / c inside, c log2(e) outside); over int4's centred keys it takes q . mean back first.
    ALiBi's slopes go in times log2(e) (float32)."""
    extra = {}
    if sliding_window is not None:
        extra.update(window=int(sliding_window), SLIDING=True)
    if alibi_slopes is not None:
        extra.update(alibi_ptr=(alibi_slopes.float() * _LOG2E).contiguous(), ALIBI=True)
    if logit_softcap is None:
        return scale * _LOG2E, extra
    extra.update(softcap_log2=float(logit_softcap) * _LOG2E, SOFTCAP=True)
    if k_mean is not None:
        extra.update(mean_ptr=k_mean, CENTRED=True)
    return scale / float(logit_softcap), extra


def paged_prefill_attention(q, k_cache, v_cache, block_tables, q_start_loc, q_seqlens, kv_seqlens, scale, max_q_len,
                            max_kv_len, tiles=None, out=None, k_scale_zero=None, v_scale_zero=None,
                            sliding_window=None, logit_softcap=None, k_mean=None, alibi_slopes=None):
    """``tiles``: (block_m, block_n, warps, stages[, pack]) instead of prefill_tiles' (for sweeps); heads are
    packed only where a KV head's query heads are a power of two that divides block_m. ``sliding_window``,
    ``logit_softcap``, ``alibi_slopes``: the interface's (``k_mean``: the int4 cache's, devices/cache.py)."""
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    if t == 0 or q_seqlens.shape[0] == 0:
        return out
    block_d = triton.next_power_of_2(d)
    group = h // hkv
    qk, ksz, vsz, zstrides, consts = _scales(q, k_cache, v_cache, k_scale_zero, v_scale_zero)
    on_cuda = q.device.type == 'cuda'
    smem = shared_memory(q.device) if on_cuda else 227 * 1024
    block_m, block_n, warps, stages, pack = (tuple(tiles) + (False, ))[:5] if tiles else prefill_tiles(
        block_d, max_q_len, group, consts['QUANT'], smem, not on_cuda or tensor_core_dots(q.device))
    pack = bool(pack) and _packs(group, block_m)
    grid = (hkv if pack else h, q_seqlens.shape[0], triton.cdiv(max_q_len, block_m // group if pack else block_m))
    scale_log2, extra = _variant(scale, sliding_window, logit_softcap, k_mean, alibi_slopes)
    _prefill_kernel[grid](qk, k_cache, v_cache, ksz, vsz, out, block_tables, q_start_loc, q_seqlens, kv_seqlens,
                          scale_log2, qk.stride(0), qk.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
                          k_cache.stride(1), k_cache.stride(2), *zstrides, block_tables.stride(0), h, GROUP=group,
                          BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_D=block_d, PACK=pack, num_warps=warps, num_stages=stages, **consts, **extra)
    return out


@triton.jit
def _context_slices(kv_len, num_splits, min_slice, TILE: tl.constexpr):
    """(tokens a slice, slices filled) of a kv_len-token context: as many of
    the num_splits slices launched as it has min_slice tokens for, each a
    whole number of tiles (splits.py; the compiled kernels' context_slice)."""
    used = tl.maximum(1, tl.minimum(num_splits, kv_len // min_slice))
    per = tl.cdiv(tl.cdiv(kv_len, used), TILE) * TILE
    return per, tl.maximum(1, tl.cdiv(kv_len, tl.maximum(per, 1)))


# The slice count and the partial buffer's strides vary with the batch and its longest context: as plain
# integers they leave one compiled variant for every step (a prefill step's decode rows run eagerly, at
# slice counts no captured graph compiled; a cold-cache H100 run lost ~4 s, most likely to such compiles).
@triton.jit
def _window_start(kv_len, window, SLIDING: tl.constexpr, TILE: tl.constexpr):
    """Where a decode row's context is read from: its window's first tile (blocks wholly before the
    window are never read), else 0."""
    if SLIDING:
        start = tl.maximum(kv_len - window, 0) // TILE * TILE
    else:
        start = 0
    return start


@triton.jit(**no_respecialising(ints=['stride_bt', 'stride_pb', 'stride_ph', 'stride_ps', 'num_splits',
                                      'min_slice', 'window'],
                                pointers=['tables_ptr', 'kv_lens_ptr', 'order_ptr']))
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, part_ptr, out_ptr, tables_ptr, kv_lens_ptr, order_ptr,
                   scale_log2, stride_qb, stride_qh, stride_ob, stride_oh, stride_cn, stride_cs, stride_ch, stride_zn,
                   stride_zs, stride_zh, stride_bt, stride_pb, stride_ph, stride_ps, num_splits, min_slice,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   ORDERED: tl.constexpr, QUANT: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
                   window=0, softcap_log2=0.0, mean_ptr=None, SLIDING: tl.constexpr = False,
                   SOFTCAP: tl.constexpr = False, CENTRED: tl.constexpr = False, alibi_ptr=None,
                   ALIBI: tl.constexpr = False):
    """One program: the GROUP query heads sharing KV head ``kvh`` of
    sequence ``b``, over one slice of the context. Programs start in launch
    order, so with ``order`` the longest sequences' programs (all their
    heads and slices together) go first and the short ones fill in behind
    them, instead of a long one starting late and finishing alone. A
    sequence fills only the slices it has ``min_slice`` tokens for
    (splits.py): the programs of the others return at once, and a sequence
    of one slice is written out here, without the merge. ``SLIDING``: the
    slices cut the window's tiles only (from ``_window_start``), the tokens
    before it masked in its first tile; ``SOFTCAP``, ``ALIBI``: as the prefill's."""
    pdl.wait_then_release(PDL)
    pid = tl.program_id(0)
    split = pid % num_splits
    kvh = (pid // num_splits) % NUM_KV_HEADS
    b = pid // (num_splits * NUM_KV_HEADS)
    if ORDERED:
        b = tl.load(order_ptr + b)
    b = b.to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + b).to(tl.int32)
    first = _window_start(kv_len, window, SLIDING, BLOCK_N)
    per_split, count = _context_slices(kv_len - first, num_splits, min_slice, BLOCK_N)
    if split >= count:
        return
    start = first + split * per_split
    end = tl.minimum(kv_len, start + per_split)
    g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + g
    g_valid = g < GROUP
    q, q2, q_sum = _load_query(q_ptr + b * stride_qb + heads * stride_qh, g_valid, HEAD_DIM, BLOCK_D, BLOCK_HALF,
                               QUANT)
    m_i = tl.full([BLOCK_G], float('-inf'), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_HALF if QUANT != 0 else BLOCK_D], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_G, BLOCK_HALF if QUANT != 0 else 1], dtype=tl.float32)
    table = tables_ptr + b * stride_bt
    q_shift = _mean_shift(q, q2, mean_ptr, kvh, HEAD_DIM, BLOCK_HALF, CENTRED) if SOFTCAP else 0.0
    slope = tl.load(alibi_ptr + heads, mask=g_valid, other=0.0) if ALIBI else 0.0
    q_pos = kv_len - 1 + tl.zeros([BLOCK_G], dtype=tl.int32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        if SLIDING:  # (tokens before the window are not read: their block may be gone)
            n_valid = n_valid & (offs_n >= kv_len - window)
        page, in_block = _tile_pages(table, start_n, n_valid, BLOCK_SIZE, BLOCK_N)  # (slices start on tiles)
        bias = _alibi_bias(slope, offs_n, q_pos) if ALIBI else 0.0
        m_i, l_i, acc, acc2 = _attend_tile(q, q2, q_sum, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, page, in_block, n_valid,
                                           n_valid[None, :], kvh, m_i, l_i, acc, acc2, scale_log2, stride_cn,
                                           stride_cs, stride_ch, stride_zn, stride_zs, stride_zh, HEAD_DIM, BLOCK_D,
                                           BLOCK_HALF, QUANT, ASM, True, softcap_log2, q_shift, SOFTCAP, False, bias,
                                           ALIBI)
    if count == 1:  # the whole context
        _store_rows(out_ptr + b * stride_ob + heads * stride_oh, acc, acc2, l_i, g_valid, HEAD_DIM, BLOCK_D,
                    BLOCK_HALF, QUANT)
    else:
        # partial result: normalised output and its log2-sum-exp2, per split
        base = part_ptr + b * stride_pb + heads * stride_ph + split * stride_ps
        _store_rows(base, acc, acc2, l_i, g_valid, HEAD_DIM, BLOCK_D, BLOCK_HALF, QUANT)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float('-inf'))
        tl.store(base + HEAD_DIM, lse, mask=g_valid)


@triton.jit(**no_respecialising(ints=['stride_pb', 'stride_ph', 'num_splits', 'min_slice', 'window'],
                                pointers=['kv_lens_ptr']))
def _decode_reduce_kernel(part_ptr, out_ptr, kv_lens_ptr, stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
                          num_splits, min_slice, HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr, window=0,
                          SLIDING: tl.constexpr = False, BLOCK_S: tl.constexpr = 8):
    """Merge one head's slices (any count up to MAX_SPLITS, masked: one
    compiled variant for every slice count) by their log-sum-exp: those
    its sequence filled; one slice was written out already. The partial
    rows are read BLOCK_S at a time: all MAX_SPLITS of them at once is a
    [64, head_dim] float32 tile, which at head_dim 256 spills its registers
    (H100, Gemma2-9B's heads at batch 64: 48 us a call, half the layer's
    attention)."""
    pdl.wait_then_release(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kv_len = tl.load(kv_lens_ptr + b).to(tl.int32)
    _, count = _context_slices(kv_len - _window_start(kv_len, window, SLIDING, BLOCK_N), num_splits, min_slice,
                               BLOCK_N)
    if count == 1:
        return
    s = tl.arange(0, MAX_SPLITS)
    base = part_ptr + b * stride_pb + h * stride_ph
    top = tl.max(tl.load(base + s * stride_ps + HEAD_DIM, mask=s < count, other=float('-inf')), axis=0)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = 0.0
    for first in range(0, count, BLOCK_S):
        c = first + tl.arange(0, BLOCK_S)
        c_valid = c < count
        lse = tl.load(base + c * stride_ps + HEAD_DIM, mask=c_valid, other=float('-inf'))
        w = tl.where(lse > float('-inf'), tl.exp2(lse - top), 0.0)
        total += tl.sum(w, axis=0)
        parts = tl.load(base + c[:, None] * stride_ps + offs_d[None, :], mask=c_valid[:, None] & d_mask[None, :],
                        other=0.0)
        acc += tl.sum(parts * w[:, None], axis=0)
    out = acc / tl.maximum(total, 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_tiles(smem_bytes: int, batch: int, quant: int = 0, head_dim: int = 128) -> Tuple[int, int, int]:
    """(context tokens a tile, tiles in flight, warps) for the decode kernel. From
    128 sequences on a Hopper-sized shared memory: 128-token tiles, 3 in
    flight (H100, 248 sequences of lognormal context lengths: 130 -> 120
    us a layer; 128 sequences: 107 -> 101). Otherwise 64-token tiles (batch
    1 keeps its many short slices), 2 in flight where 96 KB fit, 1 on
    Turing. A quantized cache (H100 sweep, batch 64-256, contexts 512-4k,
    benchmark/kv_quant_attn.py --tiles): int8 64 x 2 at every batch (at
    batch 256 and 1k context 283 us against 346 with 128 x 3), int4 128 x 3
    from 16 sequences (batch 64 and 4k context: 247 against 270 with 64 x 2).
    A 16-bit cache with heads over 128 wide (Gemma's 256): 64-token tiles,
    2 in flight, 8 warps below 128 sequences, 4 from there (H100, 16/8
    heads of 256, lognormal contexts around 450, benchmark/decode_tiles.py:
    205 sequences 417 us a layer with 128 x 3 -> 301 us, 307 with 8 warps;
    64 sequences 106 us with 4 warps -> 95 us)."""
    big = smem_bytes >= 200 * 1024
    stages = 2 if smem_bytes >= 96 * 1024 else 1
    if quant == 0 and head_dim > 128:  # (Turing's 64 KB: 32-token tiles, 40 KB; 64 would need 80)
        return (64, 2, 4 if batch >= 128 else 8) if stages == 2 else (32, 1, 8)
    if (batch >= 128 and quant != 8 or batch >= 16 and quant == 4) and big:
        return 128, 3, 4
    return 64, stages, 4


def _decode_tiles(q: torch.Tensor, quant: int) -> Tuple[int, int, int]:
    if q.device.type != 'cuda':
        return 64, 2, 4  # the interpreter: stages and warps are ignored
    return decode_tiles(shared_memory(q.device), q.shape[0], quant, triton.next_power_of_2(q.shape[-1]))


def paged_decode_attention(q, k_cache, v_cache, block_tables, kv_seqlens, scale, max_kv_len, num_sms: int = 132,
                           order=None, out=None, k_scale_zero=None, v_scale_zero=None, tiles=None,
                           sliding_window=None, logit_softcap=None, k_mean=None, alibi_slopes=None):
    """``tiles``: (context tokens a tile, tiles in flight, warps) instead of decode_tiles' (for sweeps).
    ``sliding_window``, ``logit_softcap``: the interface's (``k_mean``: the int4 cache's); a window bounds
    the context the slices are cut for (reads and slices stay within it, however long the sequence)."""
    bsz, h, d = q.shape
    hkv = k_cache.shape[2]
    group = h // hkv
    out = torch.empty_like(q) if out is None else out
    if bsz == 0:
        return out
    block_d = triton.next_power_of_2(d)
    qk, ksz, vsz, zstrides, consts = _scales(q, k_cache, v_cache, k_scale_zero, v_scale_zero)
    block_n, stages, warps = tiles or _decode_tiles(q, consts['QUANT'])
    if sliding_window is not None:  # (the window's tokens and the tile its first one falls in)
        max_kv_len = min(max_kv_len, int(sliding_window) + block_n)
    splits = num_decode_splits(bsz, hkv, max_kv_len, num_sms)
    scale_log2, extra = _variant(scale, sliding_window, logit_softcap, k_mean, alibi_slopes)
    # float32 even when unused (one slice writes straight to out): a pointer of out's dtype here would be
    # another compiled variant, which a prefill step's few short decode rows could need mid-run
    part = torch.empty((bsz, h, splits, d + 1) if splits > 1 else (1, 1, 1, 1), dtype=torch.float32,
                       device=q.device)
    # Longest first pays from 16 sequences (H100, lognormal contexts: 248 sequences 113 -> 107 us, 200: 133 ->
    # 115); below that the order's extra dependent load at each program's start costs more than it balances.
    if bsz < 16:
        order = None
    min_slice = min_slice_tokens(bsz, hkv, num_sms)
    _decode_kernel[(bsz * hkv * splits, )](qk, k_cache, v_cache, ksz, vsz, part, out, block_tables, kv_seqlens,
                                           kv_seqlens if order is None else order, scale_log2, qk.stride(0),
                                           qk.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
                                           k_cache.stride(1), k_cache.stride(2), *zstrides, block_tables.stride(0),
                                           part.stride(0), part.stride(1), part.stride(2), splits, min_slice,
                                           NUM_KV_HEADS=hkv, GROUP=group,
                                           BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=k_cache.shape[1],
                                           HEAD_DIM=d, BLOCK_N=block_n, BLOCK_D=block_d, ORDERED=order is not None,
                                           num_warps=warps, num_stages=stages, PDL=pdl.ON, **consts, **pdl.LAUNCH,
                                           **extra)
    if splits > 1:
        _decode_reduce_kernel[(bsz, h)](part, out, kv_seqlens, part.stride(0), part.stride(1), part.stride(2),
                                        out.stride(0), out.stride(1), splits, min_slice, HEAD_DIM=d,
                                        MAX_SPLITS=MAX_DECODE_SPLITS, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4,
                                        PDL=pdl.ON, **pdl.LAUNCH,
                                        **{k: v for k, v in extra.items() if k in ('window', 'SLIDING')})
    return out
