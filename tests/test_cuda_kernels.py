"""The cuda device's Triton kernels against the cpu reference ops.

Without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1) on
small shapes; with one (LMDEPLOY_TEST_FULL=1) at full size on the GPU.
"""
import ctypes
import dataclasses
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault('TRITON_INTERPRET', '1')
import triton  # noqa: E402,F401  (a test dependency: these tests must not skip silently)

from helpers import benchmark_module  # noqa: E402
from paged_cache import reference_filled_cache  # noqa: E402

from lmdeploy.devices import get_device  # noqa: E402
from lmdeploy.devices.cache import KVCache, row_strides, unpack_int4  # noqa: E402
from lmdeploy.devices.cuda.kernels import activation, argmax, attention, kv_cache, linear, norm, rotary, sample  # noqa: E402

DEV = 'cuda' if HAS_CUDA else 'cpu'
FULL = HAS_CUDA and os.environ.get('LMDEPLOY_TEST_FULL') == '1'
REF = get_device('cpu')
DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float32, torch.float16]


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), 'non-finite output'
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(int.from_bytes(os.urandom(4), 'little'))


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('with_residual', [False, True])
def test_rms_norm(dtype, with_residual):
    t, n = (257, 4096) if FULL else (7, 96)
    x = torch.randn(t, n, dtype=dtype, device=DEV)
    w = (1 + 0.1 * torch.randn(n)).to(dtype).to(DEV)
    res = torch.randn(t, n, dtype=dtype, device=DEV) if with_residual else None
    out, r = norm.rms_norm(x, w, 1e-6, res)
    ref, ref_r = REF.rms_norm(x.cpu().float(), w.cpu().float(), 1e-6, res.cpu().float() if with_residual else None)
    assert rel_err(out, ref) < tol(dtype) * 2
    if with_residual:
        assert rel_err(r, ref_r) < tol(dtype)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('rows', [1, 3, 8])
@pytest.mark.parametrize('with_bias', [False, True])
def test_skinny_linear(dtype, rows, with_bias):
    shapes = [(4096, 6144), (14336, 4096), (4096, 128256)] if FULL else [(300, 70), (48, 33)]
    for k, n in shapes:  # K and N that are not multiples of the block sizes too
        x = torch.randn(rows, k, dtype=dtype, device=DEV)
        w = (torch.randn(n, k) * k**-0.5).to(dtype).to(DEV)
        b = torch.randn(n, dtype=dtype, device=DEV) if with_bias else None
        out = linear.skinny_linear(x, w, b)
        ref = REF.linear(x.cpu().float(), w.cpu().float(), b.cpu().float() if with_bias else None)
        assert out.shape == (rows, n) and out.dtype == dtype
        assert rel_err(out, ref) < tol(dtype)


def test_skinny_gemm_stages_fit_every_gpus_shared_memory():
    # Hopper keeps the measured 4 stages; GPUs with less shared memory per block get fewer, never 0
    assert linear.pipeline_stages(227 * 1024) == 4
    for kib in (163, 99, 96, 64, 48):
        stages = linear.pipeline_stages(kib * 1024)
        assert 1 <= stages < 4
        assert stages == 1 or stages * linear._STAGE_BYTES <= (kib - 8) * 1024


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('rows', [1, 6])
@pytest.mark.parametrize('with_bias', [False, True])
def test_skinny_linear_silu_and_mul(dtype, rows, with_bias):
    shapes = [(4096, 14336)] if FULL else [(300, 70), (48, 33)]
    for k, i in shapes:
        x = torch.randn(rows, k, dtype=dtype, device=DEV)
        w = (torch.randn(2 * i, k) * k**-0.5).to(dtype).to(DEV)
        b = torch.randn(2 * i, dtype=dtype, device=DEV) if with_bias else None
        out = linear.skinny_linear_silu_and_mul(x, w, b)
        ref = REF.linear_silu_and_mul(x.cpu().float(), w.cpu().float(), b.cpu().float() if with_bias else None)
        assert out.shape == (rows, i) and out.dtype == dtype
        assert rel_err(out, ref) < tol(dtype) * 2


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('head_dim', [64, 128])
@pytest.mark.parametrize('fused_qkv', [False, True])
def test_rotary(dtype, head_dim, fused_qkv):
    t, h, hkv = (333, 32, 8) if FULL else (5, 4, 2)
    if fused_qkv:  # q and k as the model gets them: views of one qkv projection (one launch rotates both)
        qkv = torch.randn(t, (h + 2 * hkv) * head_dim, dtype=dtype, device=DEV)
        q, k, _ = qkv.split([h * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
        q, k = q.reshape(t, h, head_dim), k.reshape(t, hkv, head_dim)
        assert rotary._adjacent(q, k)
    else:
        q = torch.randn(t, h, head_dim, dtype=dtype, device=DEV)
        k = torch.randn(t, hkv, head_dim, dtype=dtype, device=DEV)
        assert not rotary._adjacent(q, k)
    pos = torch.randint(0, 4000, (t, ), device=DEV).float()
    inv = 1.0 / (10000**(torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    oq, ok = rotary.apply_rotary(q, k, cos, sin)
    rq, rk = REF.apply_rotary(q.cpu().float(), k.cpu().float(), cos.cpu(), sin.cpu())
    assert oq.shape == q.shape and ok.shape == k.shape
    assert rel_err(oq, rq) < tol(dtype) * 2 and rel_err(ok, rk) < tol(dtype) * 2


@pytest.mark.parametrize('dtype', DTYPES)
def test_silu_and_mul(dtype):
    t, i = (129, 14336) if FULL else (3, 200)
    x = torch.randn(t, 2 * i, dtype=dtype, device=DEV)
    assert rel_err(activation.silu_and_mul(x), REF.silu_and_mul(x.cpu().float())) < tol(dtype) * 2


@pytest.mark.parametrize('dtype', DTYPES)
def test_gelu_tanh_and_mul(dtype):
    t, i = (129, 16384) if FULL else (3, 200)
    x = torch.randn(t, 2 * i, dtype=dtype, device=DEV) * 3
    x[0, :6] = torch.tensor([-30.0, -9.0, 0.0, 9.0, 30.0, 1e-3])  # tanh saturating both ways, and near 0
    out = activation.gelu_tanh_and_mul(x)
    assert out.shape == (t, i) and out.dtype == dtype
    assert rel_err(out, REF.gelu_tanh_and_mul(x.cpu().float())) < tol(dtype) * 2


def make_paged(lengths, hkv, d, block_size, dtype, extra_blocks=3):
    """K/V for each sequence scattered over shuffled blocks of a cache
    poisoned with NaN; returns caches, tables and the dense K/V.

    The K/V are written at their slots directly, not by the fill kernel (what it writes there is checked
    once for each shape and dtype of the caches built here: test_fill_kv_cache_writes_each_token_at_its_slot):
    in the interpreter that kernel is one program a token, and filling took most of each attention test's time
    (~450 tokens, filled again for every tile variant, dtype and configuration)."""
    nblocks = [-(-n // block_size) for n in lengths]
    total = sum(nblocks) + extra_blocks
    k_cache = torch.full((total, block_size, hkv, d), float('nan'), dtype=dtype, device=DEV)
    v_cache = torch.full_like(k_cache, float('nan'))
    perm = torch.randperm(total).tolist()
    tables = torch.zeros((len(lengths), max(nblocks)), dtype=torch.int32)
    dense, slots = [], []
    for b, n in enumerate(lengths):
        blocks = [perm.pop() for _ in range(nblocks[b])]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        dense.append((torch.randn(n, hkv, d, dtype=dtype, device=DEV), torch.randn(n, hkv, d, dtype=dtype,
                                                                                  device=DEV)))
        slots.append(paged_slots(tables[b], n, block_size))
    for (k, v), s in zip(dense, slots):
        k_cache.view(-1, hkv, d)[s.to(DEV)] = k
        v_cache.view(-1, hkv, d)[s.to(DEV)] = v
    return k_cache, v_cache, tables.to(DEV), dense


def paged_slots(table, n, block_size):
    """The cache slots of a sequence's n tokens under its block table."""
    return torch.tensor([int(table[j // block_size]) * block_size + j % block_size for j in range(n)])


CONFIGS = [(8, 8, 64, 16), (8, 2, 64, 64), (8, 1, 128, 16)]  # H, Hkv, D, block size
# (Hkv, D, block size) of every cache make_paged builds for the tests below (at full size: 4x the KV heads)
PAGED_SHAPES = sorted({(hkv * (4 if FULL else 1), d, bs) for _, hkv, d, bs in CONFIGS} | {
    (2, 64, 16), (1, 64, 16), (1, 32, 16), (2, 32, 16), (1, 128, 64), (1, 256, 64)})


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('hkv,d,bs', PAGED_SHAPES)
def test_fill_kv_cache_writes_each_token_at_its_slot(dtype, hkv, d, bs):
    """The fill kernel writes each token's K and V at its slot of shuffled blocks and nothing else: the cache
    make_paged gives the attention tests (written directly), NaN elsewhere, for each of their KV head counts,
    head sizes and block sizes, in both dtypes. Sequences of 1 token, of a partial block and of several blocks."""
    lengths = [1, 19, 70]
    want_k, want_v, tables, dense = make_paged(lengths, hkv, d, bs, dtype)
    k_cache, v_cache = torch.full_like(want_k, float('nan')), torch.full_like(want_v, float('nan'))
    for b, (k, v) in enumerate(dense):
        kv_cache.fill_kv_cache(k, v, k_cache, v_cache, paged_slots(tables[b].cpu(), lengths[b], bs).to(DEV))
    for got, want in ((k_cache, want_k), (v_cache, want_v)):
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_fill_kv_cache_skips_negative_slots():
    k_cache = torch.full((4, 8, 2, 16), float('nan'), device=DEV)
    v_cache = torch.full_like(k_cache, float('nan'))
    k, v = torch.randn(3, 2, 16, device=DEV), torch.randn(3, 2, 16, device=DEV)
    kv_cache.fill_kv_cache(k, v, k_cache, v_cache, torch.tensor([9, -1, 30], device=DEV))
    flat_k = k_cache.view(32, 2, 16)
    assert torch.equal(flat_k[9], k[0]) and torch.equal(flat_k[30], k[2])
    assert torch.isnan(flat_k[[i for i in range(32) if i not in (9, 30)]]).all()
    assert torch.equal(v_cache.view(32, 2, 16)[30], v[2])


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('h,hkv,d', [(32, 8, 128), (12, 12, 64), (5, 1, 64)])
def test_rotary_fill_kv(dtype, h, hkv, d):
    """The fused op equals apply_rotary then fill_kv_cache (the reference),
    for q/k/v as views of one qkv projection; a negative slot writes no cache."""
    t = 333 if FULL else 6
    bs, nblocks = 16, -(-t // 16) + 2
    qkv = torch.randn(t, (h + 2 * hkv) * d, dtype=dtype, device=DEV)
    q, k, v = (x.reshape(t, -1, d) for x in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
    slots = torch.randperm(nblocks * bs, device=DEV)[:t]
    slots[t // 2] = -1
    pos = torch.randint(0, 4000, (t, ), device=DEV).float()
    inv = 1.0 / (10000**(torch.arange(0, d, 2, device=DEV).float() / d))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    caches = [torch.full((nblocks, bs, hkv, d), float('nan'), dtype=dtype, device=DEV) for _ in range(2)]
    ref_caches = [c.cpu().float() for c in caches]
    oq, ok = kv_cache.rotary_fill_kv(q, k, v, cos, sin, *caches, slots)
    rq, rk = REF.rotary_fill_kv(q.cpu().float(), k.cpu().float(), v.cpu().float(), cos.cpu(), sin.cpu(),
                                KVCache(*ref_caches), slots.cpu())
    assert oq.shape == q.shape and ok.shape == k.shape and oq.dtype == dtype
    assert rel_err(oq, rq) < tol(dtype) * 2 and rel_err(ok, rk) < tol(dtype) * 2
    for out, ref in zip(caches, ref_caches):
        out = out.cpu().float()
        written = ~torch.isnan(ref)
        assert torch.equal(written, ~torch.isnan(out))  # the same slots, none for the padding token
        assert rel_err(out[written], ref[written]) < tol(dtype) * 2


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('h,hkv,d,bs', CONFIGS)
@pytest.mark.parametrize('pack', [None, False, True])
def test_paged_prefill_attention(dtype, h, hkv, d, bs, pack):
    """The tiles auto picks (``pack`` None), and the short prompts' tiles with each query head in its own
    programs (False) or a KV head's query heads interleaved in one program's rows (True)."""
    # (kv_len, q_len): fresh prompts, and chunks after cached context
    if FULL:
        shapes = [(1000, 1000), (777, 129), (2048, 1), (301, 300), (4099, 64)]
        h, hkv = h * 4, hkv * 4
    else:
        # (150, 150) and (150, 20) reach past whole tiles below the diagonal (attended without masks)
        shapes = [(37, 37), (50, 13), (70, 1), (19, 18), (150, 150), (150, 20)]
    kv_lens = [s[0] for s in shapes]
    q_lens = [s[1] for s in shapes]
    k_cache, v_cache, tables, _ = make_paged(kv_lens, hkv, d, bs, dtype)
    q = torch.randn(sum(q_lens), h, d, dtype=dtype, device=DEV)
    q_start = torch.tensor([0] + q_lens[:-1]).cumsum(0).to(DEV)
    args = (tables, q_start, torch.tensor(q_lens, device=DEV), torch.tensor(kv_lens, device=DEV), d**-0.5,
            max(q_lens), max(kv_lens))
    tiles = None if pack is None else attention.prefill_tiles(triton.next_power_of_2(d), max(q_lens))[:4] + (pack, )
    out = attention.paged_prefill_attention(q, k_cache, v_cache, *args, tiles=tiles)
    cpu = [a.cpu() if torch.is_tensor(a) else a for a in args]
    ref = REF.paged_prefill_attention(q.cpu().float(), KVCache(k_cache.cpu().float(), v_cache.cpu().float()), *cpu)
    assert rel_err(out, ref) < tol(dtype) * 2


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('h,hkv,d,bs', CONFIGS)
def test_paged_decode_attention(dtype, h, hkv, d, bs):
    kv_lens = [4000, 1, 517, 2049, 64, 333] if FULL else [1, 70, 300, 17, 64]
    if FULL:
        h, hkv = h * 4, hkv * 4
    k_cache, v_cache, tables, _ = make_paged(kv_lens, hkv, d, bs, dtype)
    q = torch.randn(len(kv_lens), h, d, dtype=dtype, device=DEV)
    lens = torch.tensor(kv_lens, device=DEV)
    ref = REF.paged_decode_attention(q.cpu().float(), KVCache(k_cache.cpu().float(), v_cache.cpu().float()),
                                     tables.cpu(), lens.cpu(), d**-0.5, max(kv_lens))
    longest_first = torch.tensor(sorted(range(len(kv_lens)), key=lambda i: -kv_lens[i]), device=DEV)
    for num_sms in (1, 132):  # one split, and several
        for order in (None, longest_first):
            out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5, max(kv_lens),
                                                   num_sms=num_sms, order=order)
            assert rel_err(out, ref) < tol(dtype) * 2


def test_paged_decode_attention_large_batch():
    """Batches of >= 128 sequences take other tiles on a GPU (128 tokens a
    tile): contexts of varied lengths, some of one token, some spanning
    several tiles."""
    # (the interpreter always takes the small tiles, and is slow: a few short contexts there)
    n, hkv = (160, 2) if HAS_CUDA else (12, 1)
    kv_lens = torch.randint(1, 600 if HAS_CUDA else 40, (n, )).tolist()
    kv_lens[:3] = [1, 129, 128]
    dtype = DTYPES[-1]
    k_cache, v_cache, tables, _ = make_paged(kv_lens, hkv, 64, 16, dtype)
    q = torch.randn(n, 4 * hkv, 64, dtype=dtype, device=DEV)
    lens = torch.tensor(kv_lens, device=DEV)
    ref = REF.paged_decode_attention(q.cpu().float(), KVCache(k_cache.cpu().float(), v_cache.cpu().float()),
                                     tables.cpu(), lens.cpu(), 0.125, max(kv_lens))
    for order in (None, torch.randperm(n, device=DEV).to(torch.int32)):  # any permutation gives the same result
        out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, max(kv_lens), order=order)
        assert rel_err(out, ref) < tol(dtype) * 2


def test_decode_with_empty_padding_rows_gives_zeros():
    k_cache, v_cache, tables, _ = make_paged([40, 8], 2, 64, 16, DTYPES[0])
    q = torch.randn(3, 8, 64, dtype=DTYPES[0], device=DEV)
    tables = torch.cat([tables, torch.zeros_like(tables[:1])])
    lens = torch.tensor([40, 8, 0], device=DEV)
    for num_sms in (1, 132):
        for order in (None, torch.tensor([0, 1, 2], device=DEV)):
            out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, 600, num_sms=num_sms,
                                                   order=order)
            assert torch.isfinite(out).all()
            assert (out[2] == 0).all()


@pytest.mark.parametrize('vocab', [5000, 77])
def test_sample_draws_the_reference_tokens(vocab):
    """The seeded draw equals the reference's token for token (its random numbers are the same bits):
    peaked and flat rows, a filtered row (-inf outside a few tokens), a row of one token, seeds and offsets
    of every size; a second offset draws again."""
    b = 8
    if FULL:
        vocab = 128256 if vocab == 5000 else vocab
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    x = torch.randn(b, vocab, generator=gen) * torch.tensor([0.3, 1, 3, 8, 1, 1, 2, 0.5])[:, None]
    x[4, torch.randperm(vocab, generator=gen)[:vocab - 5]] = float('-inf')  # top-k 5
    x[5] = float('-inf')
    x[5, vocab // 2] = 0.0
    seeds = torch.randint(0, 1 << 62, (b, ), generator=gen)
    seeds[0] = 0
    offsets = torch.randint(0, 3000, (b, ), generator=gen)
    want = REF.sample(x, seeds, offsets)
    got = sample.sample(x.to(DEV), seeds.to(DEV), offsets.to(DEV)).cpu()
    assert torch.equal(got, want), (got, want)
    assert int(got[5]) == vocab // 2 and bool(torch.isfinite(x[4, got[4]]))
    again = sample.sample(x.to(DEV), seeds.to(DEV), (offsets + 1).to(DEV)).cpu()
    assert torch.equal(again, REF.sample(x, seeds, offsets + 1))
    assert sample.sample(x[:0].to(DEV), seeds[:0].to(DEV), offsets[:0].to(DEV)).shape == (0, )


@pytest.mark.parametrize('vocab', [5000, 2048, 77])
def test_argmax(vocab):
    """Against torch.argmax, ties included: a row whose maximum appears in
    two slices and twice in one, a row of -inf (index 0), bf16 logits."""
    b = 9
    if FULL:
        vocab = 128256 if vocab == 5000 else vocab
    x = torch.randn(b, vocab, device=DEV)
    top = float(x.max()) + 1
    cols = torch.randperm(vocab)[:3].tolist()
    for c in cols:  # row 1: three equal maxima, maybe in different slices
        x[1, c] = top
    x[2, max(cols)] = x[2, min(cols)] = top  # row 2: equal maxima, first one wins
    x[3] = float('-inf')
    assert torch.equal(argmax.argmax(x), x.argmax(dim=-1))
    assert int(argmax.argmax(x)[1]) == min(cols) and int(argmax.argmax(x)[3]) == 0
    xb = x.bfloat16() if HAS_CUDA else x.half()
    assert torch.equal(argmax.argmax(xb), xb.float().argmax(dim=-1))
    assert argmax.argmax(x[:0]).shape == (0, )


@pytest.mark.skipif(not HAS_CUDA, reason='compiled variants exist on a GPU only')
def test_prefill_attention_compiles_once_for_any_batch_layout():
    """Block-table widths and the offsets of metadata views change from step
    to step; neither may make Triton compile the kernel again (a stall of
    seconds mid-run)."""
    def run(lengths, odd_offset):
        k_cache, v_cache, tables, _ = make_paged(lengths, 2, 64, 16, torch.float16)
        q = torch.randn(sum(lengths), 8, 64, dtype=torch.float16, device=DEV)
        packed = torch.tensor([7] + lengths + lengths, device=DEV)  # like the engine's one host-to-device copy
        q_lens = packed[1:1 + len(lengths)] if odd_offset else packed[1:1 + len(lengths)].clone()
        q_start = torch.tensor([0] + lengths[:-1], device=DEV).cumsum(0)
        attention.paged_prefill_attention(q, k_cache, v_cache, tables, q_start, q_lens, q_lens.clone(), 0.125,
                                          max(lengths), max(lengths))

    def variants():
        return sum(len(c[0]) for c in attention._prefill_kernel.device_caches.values())

    run([40, 300], odd_offset=False)  # table width 19
    before = variants()
    run([10], odd_offset=True)  # width 1, q_lens 8 bytes past a 16-byte boundary
    run([16 * 16, 3, 70], odd_offset=True)  # width 16
    run([33, 5], odd_offset=False)  # width 3
    assert variants() == before


@pytest.mark.skipif(not HAS_CUDA, reason='compiled variants exist on a GPU only')
def test_decode_attention_compiles_once_for_any_slice_count():
    """A prefill step's decode rows run eagerly, at slice counts that follow
    the batch and its longest context: none may compile the decode kernels
    again (a cold-cache H100 run lost ~4 s to that mid-run)."""
    def variants():
        return sum(len(c[0]) for k in (attention._decode_kernel, attention._decode_reduce_kernel)
                   for c in k.device_caches.values())

    splits, before = set(), None
    for longest in (2100, 200, 600, 1100):  # 20 rows (ordered, small tiles): 8, 1, 2 and 4 slices
        kv_lens = torch.randint(1, longest, (20, )).tolist()
        kv_lens[0] = longest
        k_cache, v_cache, tables, _ = make_paged(kv_lens, 2, 64, 16, torch.float16)
        q = torch.randn(20, 8, 64, dtype=torch.float16, device=DEV)
        lens = torch.tensor(kv_lens, device=DEV)
        ref = REF.paged_decode_attention(q.cpu().float(), KVCache(k_cache.cpu().float(), v_cache.cpu().float()),
                                         tables.cpu(), lens.cpu(), 0.125, longest)
        out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, longest, 132,
                                               torch.argsort(lens, descending=True))
        assert rel_err(out, ref) < tol(torch.float16) * 2
        splits.add(attention.num_decode_splits(20, 2, longest, 132))
        before = variants() if before is None else before
    assert splits == {1, 2, 4, 8} and variants() == before


def test_decode_split_counts():
    """The measured choices on an H100 (132 SMs, 8 KV heads, graphs sized for
    8192 tokens): many slices for small batches, none from ~160 sequences;
    never a slice under 256 tokens."""
    splits = {b: attention.num_decode_splits(b, 8, 8192, 132) for b in (1, 8, 32, 64, 128, 160, 256)}
    assert splits == {1: 32, 8: 8, 32: 8, 64: 4, 128: 2, 160: 1, 256: 1}
    assert attention.num_decode_splits(32, 8, 300, 132) == 1
    # each sequence then fills only slices of at least 256 tokens for each program an SM has: batch 1 keeps
    # one-tile slices, 64 sequences of 1,024 tokens are not cut (nor launched in slices in an eager step)
    floors = {b: attention.min_slice_tokens(b, 8, 132) for b in (1, 8, 32, 64, 128)}
    assert floors == {1: 16, 8: 124, 32: 496, 64: 992, 128: 1985}
    assert attention.num_decode_splits(64, 8, 1024, 132) == 1 and attention.num_decode_splits(64, 8, 4096, 132) == 4


def test_decode_sequences_fill_only_the_slices_their_length_needs():
    """Under a graph's bound (8,192 tokens) 8 slices are launched for each sequence, and each fills only
    those it has min_slice_tokens for (here 128: 4 programs on 8 SMs): 1, 1, 2 and 4 slices (700 tokens:
    5 cuts of 140, rounded up to 64-token tiles, fill 4), the others return at once; the merge, which
    reads only the filled slices, gives the reference for every row."""
    kv_lens = [5, 130, 300, 700]
    assert attention.num_decode_splits(4, 1, 8192, 8) == 8 and attention.min_slice_tokens(4, 1, 8) == 128
    for dtype in DTYPES:
        k_cache, v_cache, tables, _ = make_paged(kv_lens, 1, 32, 16, dtype)
        q = torch.randn(len(kv_lens), 4, 32, dtype=dtype, device=DEV)
        lens = torch.tensor(kv_lens, device=DEV)
        ref = REF.paged_decode_attention(q.cpu().float(), KVCache(k_cache.cpu().float(), v_cache.cpu().float()),
                                         tables.cpu(), lens.cpu(), 32**-0.5, max(kv_lens))
        out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 32**-0.5, 8192, num_sms=8)
        assert rel_err(out, ref) < tol(dtype) * 2


@pytest.mark.parametrize('d', [128, 256])
def test_decode_merge_of_more_slices_than_it_reads_at_once(d):
    """The merge reads a head's partial rows 8 slices at a time. Under a graph's bound of 4,096 tokens 16
    slices are launched (3 sequences, 1 KV head, 132 SMs: slices of at least 16 tokens, cut on 64-token tiles
    here), and a 600-token context fills 10 of them (two reads) beside shorter ones; at Llama's head size and
    Gemma's (whose 256-wide heads take their own tiles on a GPU), with a soft cap, against the reference."""
    kv_lens = [600, 70, 1]
    assert attention.num_decode_splits(3, 1, 4096, 132) == 16 and attention.min_slice_tokens(3, 1, 132) == 16
    dtype = DTYPES[-1]
    k_cache, v_cache, tables, _ = make_paged(kv_lens, 1, d, 64, dtype)
    q = torch.randn(len(kv_lens), 2, d, dtype=dtype, device=DEV)
    lens = torch.tensor(kv_lens, device=DEV)
    ref = REF.paged_decode_attention(q.cpu().float(), KVCache(k_cache.cpu().float(), v_cache.cpu().float()),
                                     tables.cpu(), lens.cpu(), d**-0.5, max(kv_lens), logit_softcap=2.0)
    out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5, 4096, num_sms=132,
                                           logit_softcap=2.0)
    assert rel_err(out, ref) < tol(dtype) * 2


@pytest.mark.parametrize('window', [None, 40])
@pytest.mark.parametrize('long', [False, True])
def test_prefill_of_wide_heads_packs_a_kv_heads_query_heads(long, window):
    """Gemma 2's 256-wide heads (2 query heads a KV head, a soft cap; a sliding window shorter than the prompts,
    as its local layers have) through the packed tiles the cuda device picks for them: those of short prompts
    and those of prompts from 1,024 tokens (128 rows, 64-token context tiles), here on short prompts, fresh and
    after cached context, against the reference."""
    shapes = [(37, 37), (150, 150), (150, 20), (70, 1)]
    kv_lens, q_lens = [s[0] for s in shapes], [s[1] for s in shapes]
    dtype, h, hkv, d = DTYPES[-1], 4, 2, 256
    tiles = attention.prefill_tiles(d, 2048 if long else max(q_lens), h // hkv)
    assert tiles == ((128, 64, 8, 2, True) if long else (64, 32, 4, 2, True))
    k_cache, v_cache, tables, _ = make_paged(kv_lens, hkv, d, 16, dtype)
    q = torch.randn(sum(q_lens), h, d, dtype=dtype, device=DEV)
    q_start = torch.tensor([0] + q_lens[:-1]).cumsum(0).to(DEV)
    args = (tables, q_start, torch.tensor(q_lens, device=DEV), torch.tensor(kv_lens, device=DEV), d**-0.5,
            max(q_lens), max(kv_lens))
    out = attention.paged_prefill_attention(q, k_cache, v_cache, *args, tiles=tiles, logit_softcap=2.0,
                                            sliding_window=window)
    cpu = [a.cpu() if torch.is_tensor(a) else a for a in args]
    ref = REF.paged_prefill_attention(q.cpu().float(), KVCache(k_cache.cpu().float(), v_cache.cpu().float()), *cpu,
                                      logit_softcap=2.0, sliding_window=window)
    assert rel_err(out, ref) < tol(dtype) * 2


def test_prefill_tiles_for_wide_heads():
    """Packed tiles for 256-wide heads where a KV head's query heads pack (and the shared memory holds them);
    each query head in its own 32-row programs otherwise, as before (H200 sweep in prefill_tiles)."""
    hopper, ampere, turing = 227 * 1024, 163 * 1024, 64 * 1024
    assert attention.prefill_tiles(256, 3000, 2, 0, hopper) == (128, 64, 8, 2, True)
    assert attention.prefill_tiles(256, 3000, 2, 0, ampere) == (64, 32, 4, 2, True)
    assert attention.prefill_tiles(256, 3000, 2, 0, turing) == (32, 32, 4, 2, False)
    assert attention.prefill_tiles(256, 3000, 3, 0, hopper) == (32, 32, 4, 2, False)  # 3 heads do not pack
    assert attention.prefill_tiles(256, 3000, 2, 8, hopper) == (32, 32, 4, 2, False)  # quantized: as measured


def test_prefill_tiles_for_long_prompts_need_tensor_core_dots():
    """Long prompts take the larger tiles (128-wide heads) where Triton's dots run on tensor cores and the shared
    memory holds them; Volta (96 KB, FMA dots) keeps the short prompts' tiles, as Turing (64 KB) does."""
    volta = 96 * 1024
    for quant, long, short in ((0, (128, 32), (64, 32)), (8, (64, 128), (64, 64)), (4, (64, 128), (64, 64))):
        assert attention.prefill_tiles(128, 3000, 4, quant, volta)[:2] == long
        assert attention.prefill_tiles(128, 3000, 4, quant, volta, tensor_cores=False)[:2] == short
        assert attention.prefill_tiles(128, 100, 4, quant, volta, tensor_cores=False)[:2] == short
        assert attention.prefill_tiles(128, 3000, 4, quant, 64 * 1024)[:2] == short


def test_decode_tiles_for_wide_heads():
    """A 16-bit cache with 256-wide heads reads 64-token tiles at every batch (not the 128-token tiles that
    128-wide heads take from 128 sequences), with 8 warps below 128 sequences; 32-token ones where 64 KB of
    shared memory is all."""
    hopper, turing = 227 * 1024, 64 * 1024
    assert attention.decode_tiles(hopper, 256) == (128, 3, 4)
    assert {attention.decode_tiles(hopper, b, 0, 256) for b in (1, 64, 127)} == {(64, 2, 8)}
    assert attention.decode_tiles(hopper, 128, 0, 256) == attention.decode_tiles(hopper, 256, 0, 256) == (64, 2, 4)
    assert attention.decode_tiles(turing, 256, 0, 256) == (32, 1, 8)
    assert attention.decode_tiles(hopper, 256, 4, 256) == (128, 3, 4)  # quantized caches: as measured at 128


def test_prefill_step_with_decode_rows_through_the_attention_layer():
    """A prefill step that carries decoding sequences (one-token rows first,
    attended by the decode kernel in longest-first order; prompt rows by the
    prefill kernel, one of them a chunk after a cached prefix) gives the cpu
    reference's result for the whole batch attended as one prefill."""
    from lmdeploy.devices.cuda.ops import CudaOps
    from lmdeploy.engine.nn import PagedAttention, StepContext
    from lmdeploy.engine.nn.build import building
    h, hkv, d, bs = 8, 2, 32, 16
    kv_lens, q_lens = [37, 5, 90, 20, 30], [1, 1, 1, 20, 7]
    dtype = DTYPES[-1]
    k_cache, v_cache, tables, _ = make_paged(kv_lens, hkv, d, bs, dtype)
    t = sum(q_lens)
    q, k, v = (torch.randn(t, n, d, dtype=dtype, device=DEV) for n in (h, hkv, hkv))
    angles = torch.rand(t, d // 2, device=DEV) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rows = [(b, kv - ql + i) for b, (kv, ql) in enumerate(zip(kv_lens, q_lens)) for i in range(ql)]
    tab = tables.cpu()
    slots = torch.tensor([int(tab[b, p // bs]) * bs + p % bs for b, p in rows], device=DEV)
    starts = torch.tensor([0] + q_lens[:-1]).cumsum(0)
    with building(get_device('cpu')):
        layer = PagedAttention(0, h, hkv, d)

    def run(on, num_decode, order=None):
        as_ref = dict(device='cpu', dtype=torch.float32) if num_decode == 0 else dict(device=on)  # reference: fp32
        kc, vc = k_cache.clone().to(**as_ref), v_cache.clone().to(**as_ref)
        ctx = StepContext(is_decode=False, q_start_loc=starts.to(on), q_seqlens=torch.tensor(q_lens, device=on),
                          kv_seqlens=torch.tensor(kv_lens, device=on), block_tables=tables.to(on),
                          slot_mapping=slots.to(on), rope_lens=torch.ones(t, dtype=torch.int64, device=on),
                          max_q_len=max(q_lens), max_kv_len=max(kv_lens), kv_caches=[KVCache(kc, vc)],
                          num_decode=num_decode, decode_order=order)
        return layer(q.to(**as_ref), k.to(**as_ref), v.to(**as_ref), cos.to(on), sin.to(on), ctx)

    ref = run('cpu', 0)  # every sequence through the reference prefill op
    # the cuda device's kernels (interpreted, for tensors on the CPU, without a GPU)
    with building(get_device('cuda') if HAS_CUDA else CudaOps(num_sms=132)):
        layer = PagedAttention(0, h, hkv, d)
    out = run(DEV, 3, torch.tensor([2, 0, 1], device=DEV))
    assert rel_err(out, ref) < tol(dtype) * 2


def test_gemm_sweep_kernel_matches_torch():
    """benchmark/gemm_sweep.py's candidate GEMM (tiles, split-K with atomics)
    gives x @ w.T, so its timings compare like with like."""
    cfgs = [(16, 32, 32, 2, 4, 1), (32, 16, 32, 2, 4, 2), (16, 16, 16, 2, 4, 4)]
    assert benchmark_module('gemm_sweep').check(DEV, DTYPES[-1], [(5, 40, 100), (33, 17, 64)], cfgs)


def test_tma_gemm_candidates_match_torch():
    """benchmark/gemm_tma.py's GEMM and its silu-fused variant (tiles by TMA
    descriptor, persistent or not) against torch, partial tiles included."""
    assert benchmark_module('gemm_tma').check(DEV, torch.float16)


def test_decode_attention_candidates_match_the_kernel_in_use():
    """benchmark/decode_attn_sweep.py's page-walking variants (plain loads and
    TMA) give what the decode kernel in use gives, NaN in unowned slots."""
    assert benchmark_module('decode_attn_sweep').check(DEV, DTYPES[0])


def test_cublaslt_heuristic_result_has_the_headers_layout():
    """benchmark/cublaslt_algos.py reads cuBLASLt's suggestions through ctypes:
    cublasLtMatmulHeuristicResult_t is a 64-byte algorithm, the workspace
    size, a status, the wave count and four reserved ints (cublasLt.h)."""
    lt = benchmark_module('cublaslt_algos')
    h = lt.Heuristic
    assert (h.algo.offset, h.workspace_size.offset, h.state.offset, h.waves.offset, h.reserved.offset) == \
        (0, 64, 72, 76, 80)
    assert ctypes.sizeof(lt.Algo) == 64 and ctypes.sizeof(h) == 96


# ------------------------------------------------------------ quantized KV cache
def quant_cache(lengths, hkv, d, block_size, dtype, policy, head_major=False):
    """A quantized cache filled by the reference, with shuffled blocks (stored token- or head-major): the
    attention kernels must read exactly what the reference's attention reads."""
    return reference_filled_cache(lengths, hkv, d, block_size, dtype, policy, DEV, head_major=head_major)


@pytest.mark.parametrize('policy', [8, 4])
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('h,hkv,d,bs', CONFIGS)
@pytest.mark.parametrize('head_major', [False, True])
def test_quantized_decode_and_prefill_attention(policy, dtype, h, hkv, d, bs, head_major):
    """Dequantized in the kernels' registers, a quantized cache gives the reference's attention over the
    same cache (GQA 1/4/8, head_dim 64/128, block size 16/64, odd lengths over many blocks), whichever
    order its blocks are stored in (the cuda device's: head-major)."""
    kv_lens = [4000, 1, 517, 2049, 64, 333] if FULL else [1, 70, 43, 17, 140]
    if FULL:
        h, hkv = h * 4, hkv * 4
    ref_cache, cache, tables = quant_cache(kv_lens, hkv, d, bs, dtype, policy, head_major)
    lens = torch.tensor(kv_lens)
    q = torch.randn(len(kv_lens), h, d, dtype=dtype, device=DEV)
    ref = REF.paged_decode_attention(q.cpu().float(), ref_cache, tables, lens, d**-0.5, max(kv_lens))
    for num_sms in (1, 132):
        out = attention.paged_decode_attention(q, cache.k, cache.v, tables.to(DEV), lens.to(DEV), d**-0.5,
                                               max(kv_lens), num_sms=num_sms, k_scale_zero=cache.k_scale_zero,
                                               v_scale_zero=cache.v_scale_zero)
        assert rel_err(out, ref) < tol(dtype) * 3
    # prefill: the last q_len tokens of each sequence attend causally over the cache
    q_lens = [min(n, q) for n, q in zip(kv_lens, [1, 13, 43, 5, 64, 29])]
    qp = torch.randn(sum(q_lens), h, d, dtype=dtype, device=DEV)
    q_start = torch.tensor([0] + q_lens[:-1]).cumsum(0)
    args = (tables, q_start, torch.tensor(q_lens), lens, d**-0.5, max(q_lens), max(kv_lens))
    ref = REF.paged_prefill_attention(qp.cpu().float(), ref_cache, *args)
    for pack in (None, False, True):  # auto's tiles; each query head in its own programs; a KV head's in one's
        tiles = None if pack is None else attention.prefill_tiles(triton.next_power_of_2(d), max(q_lens))[:4] + (
            pack, )
        out = attention.paged_prefill_attention(qp, cache.k, cache.v, *(a.to(DEV) if torch.is_tensor(a) else a
                                                                        for a in args),
                                                k_scale_zero=cache.k_scale_zero, v_scale_zero=cache.v_scale_zero,
                                                tiles=tiles)
        assert rel_err(out, ref) < tol(dtype) * 3, pack


@pytest.mark.parametrize('policy,centred', [(8, False), (4, False), (4, True)])
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('fused', [False, True])
@pytest.mark.parametrize('head_major', [False, True])
def test_quantizing_fill_kernels_write_the_reference_codes(policy, centred, dtype, fused, head_major):
    """The fill kernels (alone, and fused with rotary) quantize as the reference does: the same codes
    (a rounding tie may land one code off), the same float16 scales and zeros; negative slots write
    nothing; int4's K less the layer's mean key where the cache has one. The fused kernel quantizes the
    rotated k it returns (which matches the reference's rotation to rounding: one ulp moves a row's
    minimum, and with it the zero, so the codes are compared with the reference's quantization of that
    k). The cache on the device stores its blocks token- or head-major (the cuda device's), the reference's
    token-major: the same values in another order."""
    t, h, hkv, d, bs, nblocks = 9, 4, 2, 64, 4, 6
    q = torch.randn(t, h, d, dtype=dtype, device=DEV)
    k = (torch.randn(t, hkv, d) * torch.rand(t, hkv, 1) * 5).to(dtype).to(DEV)
    v = torch.randn(t, hkv, d, dtype=dtype, device=DEV)
    slots = torch.tensor([3, -1, 9, 0, 14, 22, 5, -1, 17], device=DEV)
    spec = REF.kv_cache_spec(hkv, d, bs, dtype, policy)
    ref, got = spec.allocate(nblocks, 'cpu'), dataclasses.replace(spec, head_major=head_major).allocate(nblocks, DEV)
    assert row_strides(got.k, got.v, got.k_scale_zero, got.v_scale_zero) == ((hkv * bs, 1, bs) if head_major
                                                                             else (hkv * bs, hkv, 1))
    for c in (ref, got):
        for x in c.tensors().values():
            x.zero_()
    if centred:  # a mean key of the size the keys have, not zero
        mean = torch.randn(hkv, d) * 3
        ref.set_key_mean(mean)
        got.set_key_mean(mean.to(DEV))
    if fused:
        angles = torch.rand(t, d // 2, device=DEV) * 6.3
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        oq, ok = kv_cache.rotary_fill_kv(q, k, v, cos, sin, got.k, got.v, slots, got.k_scale_zero, got.v_scale_zero,
                                         got.k_mean)
        rq, rk = REF.rotary_fill_kv(q.cpu(), k.cpu(), v.cpu(), cos.cpu(), sin.cpu(), ref, slots.cpu())
        assert rel_err(ok, rk) < tol(dtype) * 2 and rel_err(oq, rq) < tol(dtype) * 2
        REF.fill_kv_cache(ok.cpu(), v.cpu(), ref, slots.cpu())
    else:
        kv_cache.fill_kv_cache(k, v, got.k, got.v, slots, got.k_scale_zero, got.v_scale_zero, got.k_mean)
        REF.fill_kv_cache(k.cpu(), v.cpu(), ref, slots.cpu())
    for name in ('k', 'v'):
        a, b = getattr(got, name).cpu(), getattr(ref, name)
        if policy == 4:
            a, b = unpack_int4(a), unpack_int4(b)
        assert (a.int() - b.int()).abs().max() <= 1 and (a != b).float().mean() < 0.02
        sz, ref_sz = getattr(got, f'{name}_scale_zero').cpu(), getattr(ref, f'{name}_scale_zero')
        if policy == 4 and name == 'k':  # rotated by a dot in another order: a row's min and max move by ulps
            assert torch.allclose(sz.float(), ref_sz.float(), rtol=2e-3, atol=1e-4)
        else:
            assert torch.equal(sz, ref_sz)
    written = set(slots[slots >= 0].tolist())
    untouched = [s for s in range(nblocks * bs) if s not in written]
    assert (got.k.cpu().flatten(0, 1)[untouched] == 0).all()
    assert (got.v_scale_zero.cpu().flatten(0, 1)[untouched] == 0).all()
