"""The cpu device's ops against independent formulas written in the test.

Every reference below is written differently from ``lmdeploy/devices/reference.py``
(python loops, float64, complex numbers, dense per-sequence K/V) and follows
the docstrings of :mod:`lmdeploy.devices.interface`.
"""
import math
import random

import pytest
import torch

from lmdeploy.devices import get_device, rng
from lmdeploy.devices.cache import KVCache


@pytest.fixture(scope='module', autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add synchronisation overhead."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope='module')
def ops():
    return get_device('cpu')


def _gen(seed):
    g = torch.Generator().manual_seed(seed)
    return g


# ----------------------------------------------------------------- dense ops
def test_embedding(ops):
    g = _gen(0)
    weight = torch.randn(37, 24, generator=g)
    ids = torch.tensor([5, 0, 36, 5, 17, 0, 2])
    out = ops.embedding(ids, weight)
    assert out.shape == (7, 24) and out.dtype == weight.dtype
    for t, i in enumerate(ids.tolist()):
        assert torch.equal(out[t], weight[i])


@pytest.mark.parametrize('with_bias', [False, True])
def test_linear(ops, with_bias):
    g = _gen(1)
    x = torch.randn(5, 12, generator=g)
    w = torch.randn(7, 12, generator=g)
    b = torch.randn(7, generator=g) if with_bias else None
    out = ops.linear(x, w, b)
    assert out.shape == (5, 7)
    ref = torch.empty(5, 7, dtype=torch.float64)
    for t in range(5):
        for o in range(7):
            acc = sum(float(x[t, i]) * float(w[o, i]) for i in range(12))
            ref[t, o] = acc + (float(b[o]) if with_bias else 0.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def _rms_ref(h, weight, eps):
    """Row by row in float64: weight * h / sqrt(mean(h^2) + eps)."""
    out = torch.empty(h.shape, dtype=torch.float64)
    for r in range(h.shape[0]):
        row = [float(v) for v in h[r]]
        rms = math.sqrt(sum(v * v for v in row) / len(row) + eps)
        for c, v in enumerate(row):
            out[r, c] = float(weight[c]) * v / rms
    return out


@pytest.mark.parametrize('dtype,tol', [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize('with_residual', [False, True])
def test_rms_norm(ops, dtype, tol, with_residual):
    g = _gen(2)
    eps = 1e-6
    x = (torch.randn(6, 32, generator=g) * 3).to(dtype)
    weight = (torch.randn(32, generator=g) + 1).to(dtype)
    res = torch.randn(6, 32, generator=g).to(dtype) if with_residual else None
    x_before = x.clone()
    out, h = ops.rms_norm(x, weight, eps, residual=res)
    assert torch.equal(x, x_before)  # input untouched
    if with_residual:
        h_ref = (x.float() + res.float()).to(dtype)  # the add happens in x's dtype
        assert h.dtype == dtype
        assert torch.equal(h, h_ref)
    else:
        assert h is None
        h_ref = x
    assert out.shape == x.shape
    if dtype == torch.float32:
        assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _rms_ref(h_ref, weight, eps), atol=tol, rtol=tol)


def test_apply_rotary_vs_complex(ops):
    g = _gen(3)
    t, h, hkv, d = 7, 4, 2, 16
    q = torch.randn(t, h, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    pos = torch.tensor([0, 3, 4, 10, 11, 12, 100], dtype=torch.float64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d // 2, dtype=torch.float64) * 2 / d))
    theta = pos[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = torch.cat([theta.cos(), theta.cos()], -1).float()
    sin = torch.cat([theta.sin(), theta.sin()], -1).float()
    q0, k0 = q.clone(), k.clone()
    qo, ko = ops.apply_rotary(q, k, cos, sin)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert qo.dtype == q.dtype and ko.dtype == k.dtype
    assert qo.shape == q.shape and ko.shape == k.shape

    def ref(x):
        # pair (j, j + D/2) is the complex number x_j + i x_{j+D/2}, rotated by theta_j
        z = torch.complex(x[..., :d // 2].double(), x[..., d // 2:].double())
        z = z * torch.polar(torch.ones_like(theta), theta)[:, None, :]
        return torch.cat([z.real, z.imag], -1)

    torch.testing.assert_close(qo.double(), ref(q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ko.double(), ref(k), atol=1e-5, rtol=1e-5)


def test_apply_rotary_bf16_dtype(ops):
    g = _gen(4)
    q = torch.randn(3, 2, 8, generator=g).bfloat16()
    k = torch.randn(3, 1, 8, generator=g).bfloat16()
    theta = torch.rand(3, 4, generator=g, dtype=torch.float64) * 6
    cos = torch.cat([theta.cos()] * 2, -1).float()
    sin = torch.cat([theta.sin()] * 2, -1).float()
    qo, ko = ops.apply_rotary(q, k, cos, sin)
    assert qo.dtype == torch.bfloat16 and ko.dtype == torch.bfloat16
    x1, x2 = q[..., :4].double(), q[..., 4:].double()
    c, s = theta.cos()[:, None], theta.sin()[:, None]
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    torch.testing.assert_close(qo.double(), ref, atol=5e-2, rtol=2e-2)


def test_silu_and_mul(ops):
    g = _gen(5)
    x = torch.randn(5, 2 * 9, generator=g) * 4
    out = ops.silu_and_mul(x)
    assert out.shape == (5, 9)
    for t in range(5):
        for i in range(9):
            gate, up = float(x[t, i]), float(x[t, 9 + i])
            assert abs(float(out[t, i]) - gate / (1 + math.exp(-gate)) * up) < 1e-5


# ------------------------------------------------------------- attention
def test_fill_kv_cache(ops):
    g = _gen(6)
    n, s, hkv, d = 9, 4, 2, 8
    k_cache = torch.full((n, s, hkv, d), float('nan'))
    v_cache = torch.randn(n, s, hkv, d, generator=g)
    v0 = v_cache.clone()
    t = 11
    slots = torch.randperm(n * s, generator=g)[:t]
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    ops.fill_kv_cache(k, v, KVCache(k_cache, v_cache), slots)
    written = set()
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // s, slot % s], k[i])
        assert torch.equal(v_cache[slot // s, slot % s], v[i])
        written.add(slot)
    for slot in range(n * s):
        if slot not in written:
            assert torch.isnan(k_cache[slot // s, slot % s]).all()
            assert torch.equal(v_cache[slot // s, slot % s], v0[slot // s, slot % s])


def test_fill_kv_cache_int32_slots_and_cast(ops):
    g = _gen(7)
    k_cache = torch.zeros(4, 4, 1, 4, dtype=torch.bfloat16)
    v_cache = torch.zeros(4, 4, 1, 4, dtype=torch.bfloat16)
    k = torch.randn(3, 1, 4, generator=g)
    v = torch.randn(3, 1, 4, generator=g)
    slots = torch.tensor([13, 2, 7], dtype=torch.int32)
    ops.fill_kv_cache(k, v, KVCache(k_cache, v_cache), slots)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 4, slot % 4], k[i].bfloat16())
        assert torch.equal(v_cache[slot // 4, slot % 4], v[i].bfloat16())


def test_rotary_fill_kv_is_rotary_then_fill(ops):
    g = _gen(8)
    t, h, hkv, d = 5, 4, 2, 8
    q, k, v = (torch.randn(t, n, d, generator=g) for n in (h, hkv, hkv))
    emb = torch.randn(t, d // 2, generator=g).repeat(1, 2)
    cos, sin = emb.cos(), emb.sin()
    slots = torch.tensor([3, -1, 9, 0, 14])
    caches = [torch.full((4, 4, hkv, d), float('nan')) for _ in range(2)]
    oq, ok = ops.rotary_fill_kv(q, k, v, cos, sin, KVCache(*caches), slots)
    rq, rk = ops.apply_rotary(q, k, cos, sin)
    assert torch.equal(oq, rq) and torch.equal(ok, rk)
    flat_k, flat_v = (c.view(16, hkv, d) for c in caches)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], rk[i]) and torch.equal(flat_v[slot], v[i])
    assert int(torch.isnan(flat_k).all(dim=(1, 2)).sum()) == 16 - 4


class _Paged:
    """Dense per-sequence K/V scattered into permuted blocks of a NaN cache."""

    def __init__(self, kv_lens, hkv, d, block_size, seed, dtype=torch.float32):
        g = _gen(seed)
        self.kv_lens = kv_lens
        self.block_size = block_size
        self.k = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in kv_lens]
        self.v = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in kv_lens]
        need = [(n + block_size - 1) // block_size for n in kv_lens]
        spare = 5  # never-written blocks, used as table padding
        total = sum(need) + spare
        perm = torch.randperm(total, generator=g).tolist()
        self.k_cache = torch.full((total, block_size, hkv, d), float('nan'), dtype=dtype)
        self.v_cache = torch.full((total, block_size, hkv, d), float('nan'), dtype=dtype)
        width = max(need) + 2
        pad_blocks = perm[sum(need):]
        tables = []
        pos = 0
        for b, n in enumerate(kv_lens):
            blocks = perm[pos:pos + need[b]]
            pos += need[b]
            for j in range(n):  # token by token, not via the op under test
                self.k_cache[blocks[j // block_size], j % block_size] = self.k[b][j]
                self.v_cache[blocks[j // block_size], j % block_size] = self.v[b][j]
            pad = [pad_blocks[(b + i) % len(pad_blocks)] for i in range(width - need[b])]
            tables.append(blocks + pad)
        self.block_tables = torch.tensor(tables, dtype=torch.int32)


def _naive_attention(q, k, v, pos, scale):
    """q [H, D] at position pos; k/v [L, Hkv, D] dense; causal; float64."""
    h, hkv = q.shape[0], k.shape[1]
    kv_head = torch.tensor([head // (h // hkv) for head in range(h)])  # GQA map
    kh = k[:pos + 1].double()[:, kv_head]  # [L, H, D], only positions 0..pos
    vh = v[:pos + 1].double()[:, kv_head]
    scores = (kh * q.double()[None]).sum(-1) * scale  # [L, H]
    w = torch.exp(scores - scores.max(0).values)
    w = w / w.sum(0)
    return (w[:, :, None] * vh).sum(0)


PREFILL_SEQS = [(1, 1), (7, 7), (5, 13), (3, 19), (17, 17), (2, 33), (9, 40)]  # (q_len, kv_len)


@pytest.mark.parametrize('block_size', [4, 16])
@pytest.mark.parametrize('hkv', [8, 2, 1])
@pytest.mark.parametrize('d', [32, 64])
def test_paged_prefill_attention(ops, block_size, hkv, d):
    h = 8
    q_lens = [a for a, _ in PREFILL_SEQS]
    kv_lens = [b for _, b in PREFILL_SEQS]
    cache = _Paged(kv_lens, hkv, d, block_size, seed=100 + block_size + hkv + d)
    g = _gen(hkv * d + block_size)
    t = sum(q_lens)
    q = torch.randn(t, h, d, generator=g)
    starts = [0]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n)
    scale = d ** -0.5
    out = ops.paged_prefill_attention(q, KVCache(cache.k_cache, cache.v_cache), cache.block_tables,
                                      torch.tensor(starts), torch.tensor(q_lens), torch.tensor(kv_lens), scale,
                                      max(q_lens), max(kv_lens))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    for b, (qlen, kvlen) in enumerate(PREFILL_SEQS):
        for i in range(qlen):
            row = starts[b] + i
            ref = _naive_attention(q[row], cache.k[b], cache.v[b], kvlen - qlen + i, scale)
            torch.testing.assert_close(out[row].double(), ref, atol=2e-5, rtol=2e-5)


def test_paged_prefill_attention_bf16(ops):
    h, hkv, d, bs = 8, 2, 32, 4
    seqs = [(5, 5), (3, 11)]
    cache = _Paged([b for _, b in seqs], hkv, d, bs, seed=7, dtype=torch.bfloat16)
    q = torch.randn(8, h, d, generator=_gen(8)).bfloat16()
    out = ops.paged_prefill_attention(q, KVCache(cache.k_cache, cache.v_cache), cache.block_tables,
                                      torch.tensor([0, 5]), torch.tensor([5, 3]), torch.tensor([5, 11]), d ** -0.5, 5,
                                      11)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    starts = [0, 5]
    for b, (qlen, kvlen) in enumerate(seqs):
        for i in range(qlen):
            ref = _naive_attention(q[starts[b] + i], cache.k[b], cache.v[b], kvlen - qlen + i, d ** -0.5)
            torch.testing.assert_close(out[starts[b] + i].double(), ref, atol=3e-2, rtol=3e-2)


def test_prefill_after_fill_kv_cache(ops):
    """Chunked prefill as the engine runs it: prefix cached, new tokens written by fill_kv_cache."""
    h, hkv, d, bs = 8, 2, 32, 4
    g = _gen(9)
    prefix, new = 6, 5
    k_all = torch.randn(prefix + new, hkv, d, generator=g)
    v_all = torch.randn(prefix + new, hkv, d, generator=g)
    k_cache = torch.full((8, bs, hkv, d), float('nan'))
    v_cache = torch.full((8, bs, hkv, d), float('nan'))
    blocks = [6, 1, 3]
    table = torch.tensor([blocks + [0, 0]], dtype=torch.int32)
    slots = torch.tensor([blocks[j // bs] * bs + j % bs for j in range(prefix + new)])
    ops.fill_kv_cache(k_all[:prefix], v_all[:prefix], KVCache(k_cache, v_cache), slots[:prefix])
    ops.fill_kv_cache(k_all[prefix:], v_all[prefix:], KVCache(k_cache, v_cache), slots[prefix:])
    q = torch.randn(new, h, d, generator=g)
    out = ops.paged_prefill_attention(q, KVCache(k_cache, v_cache), table, torch.tensor([0]), torch.tensor([new]),
                                      torch.tensor([prefix + new]), 0.2, new, prefix + new)
    for i in range(new):
        ref = _naive_attention(q[i], k_all, v_all, prefix + i, 0.2)
        torch.testing.assert_close(out[i].double(), ref, atol=2e-5, rtol=2e-5)


DECODE_LENS = [1, 4, 5, 16, 17, 33, 2]


@pytest.mark.parametrize('block_size', [4, 16])
@pytest.mark.parametrize('hkv', [8, 2, 1])
@pytest.mark.parametrize('d', [32, 64])
def test_paged_decode_attention(ops, block_size, hkv, d):
    h = 8
    cache = _Paged(DECODE_LENS, hkv, d, block_size, seed=200 + block_size + hkv + d)
    q = torch.randn(len(DECODE_LENS), h, d, generator=_gen(block_size * hkv + d))
    scale = d ** -0.5
    kv_lens = torch.tensor(DECODE_LENS)
    out = ops.paged_decode_attention(q, KVCache(cache.k_cache, cache.v_cache), cache.block_tables, kv_lens, scale,
                                     max(DECODE_LENS))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    for b, n in enumerate(DECODE_LENS):
        ref = _naive_attention(q[b], cache.k[b], cache.v[b], n - 1, scale)
        torch.testing.assert_close(out[b].double(), ref, atol=2e-5, rtol=2e-5)

    # the prefill op with every q_seqlen equal to 1 means the same thing
    ones = torch.ones(len(DECODE_LENS), dtype=torch.int64)
    pre = ops.paged_prefill_attention(q, KVCache(cache.k_cache, cache.v_cache), cache.block_tables,
                                      torch.arange(len(DECODE_LENS)), ones, kv_lens, scale, 1, max(DECODE_LENS))
    torch.testing.assert_close(pre, out, atol=1e-6, rtol=1e-6)


# -------------------------------------------------------------- sampling
def test_apply_repetition_penalty(ops):
    g = _gen(10)
    v = 12
    logits = torch.randn(4, v, generator=g) * 3
    logits[0, 0] = 2.5  # token 0 positive in a row that saw it
    logits[1, 0] = -1.5  # token 0 negative in a row that saw it
    logits[2, 0] = 1.7  # token 0 in rows that only have -1 padding there
    logits[3, 0] = -0.9
    token_ids = torch.tensor([
        [0, 3, 3, 3, 7, -1],  # token 0 and duplicates
        [5, 0, 0, 11, -1, -1],
        [4, 4, -1, -1, -1, -1],  # padding must not touch token 0
        [-1, -1, -1, -1, -1, -1],
    ])
    penalty = torch.tensor([1.3, 2.0, 1.5, 1.7])
    before = logits.clone()
    out = ops.apply_repetition_penalty(logits, token_ids, penalty)
    assert out.data_ptr() == logits.data_ptr()  # in place and returned
    ref = before.clone()
    for b in range(4):
        p = float(penalty[b])
        for tok in set(token_ids[b].tolist()) - {-1}:
            s = float(before[b, tok])
            ref[b, tok] = s / p if s > 0 else s * p
    torch.testing.assert_close(logits, ref, atol=0, rtol=1e-6)
    assert logits[2, 0] == before[2, 0] and logits[3, 0] == before[3, 0]
    assert torch.equal(logits[3], before[3])


@pytest.mark.parametrize('shape', ['flat', 'column'])
def test_apply_temperature(ops, shape):
    g = _gen(11)
    logits = torch.randn(3, 10, generator=g)
    temp = torch.tensor([0.5, 1.0, 1.7])
    out = ops.apply_temperature(logits, temp if shape == 'flat' else temp[:, None])
    for b in range(3):
        for i in range(10):
            assert abs(float(out[b, i]) - float(logits[b, i]) / float(temp[b])) < 1e-6


def _ref_filter_row(row, k, p, m):
    """Naive per-row top-k, top-p, min-p following the interface docstring."""
    vals = [float(x) for x in row]
    keep = [not math.isinf(x) or x > 0 for x in vals]
    n = len(vals)

    def probs():
        mx = max(vals[i] for i in range(n) if keep[i])
        e = [math.exp(vals[i] - mx) if keep[i] else 0.0 for i in range(n)]
        s = sum(e)
        return [x / s for x in e]

    if k > 0:
        kth = sorted((vals[i] for i in range(n) if keep[i]), reverse=True)[min(k, sum(keep)) - 1]
        keep = [keep[i] and vals[i] >= kth for i in range(n)]
    if p < 1.0:
        pr = probs()
        order = sorted((i for i in range(n) if keep[i]), key=lambda i: -pr[i])
        new_keep = [False] * n
        mass = 0.0
        for i in order:
            new_keep[i] = True
            mass += pr[i]
            if mass >= p:
                break
        keep = new_keep
    if m > 0.0:
        pr = probs()
        mx = max(pr)
        keep = [keep[i] and pr[i] >= m * mx for i in range(n)]
    return keep


def _check_filter(ops, logits, top_k, top_p, min_p):
    out = ops.top_k_top_p_min_p(logits, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
    assert out.data_ptr() != logits.data_ptr()
    # the host's bound on top_k (a partial top-k of that width instead of reading the largest k) changes nothing
    for bound in {max(top_k), max(top_k) + 3}:
        hinted = ops.top_k_top_p_min_p(logits, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p), bound)
        assert torch.equal(hinted, out)
    for b in range(logits.shape[0]):
        keep = _ref_filter_row(logits[b], top_k[b], top_p[b], min_p[b])
        got = torch.isfinite(out[b]).tolist()
        assert got == keep, (b, top_k[b], top_p[b], min_p[b])
        assert any(got)  # at least one token always stays
        kept = torch.tensor(keep)
        assert torch.equal(out[b][kept], logits[b][kept])  # survivors unchanged
        assert (out[b][~kept] == float('-inf')).all()
    return out


def test_top_k_alone_with_ties(ops):
    g = _gen(12)
    logits = torch.randint(0, 5, (6, 20), generator=g).float()  # many ties
    logits[5] = 1.0  # all equal
    top_k = [1, 2, 3, 7, 25, 4]
    before = logits.clone()
    out = _check_filter(ops, logits, top_k, [1.0] * 6, [0.0] * 6)
    assert torch.equal(logits, before)
    assert torch.isfinite(out[4]).all()  # k > vocab keeps all
    assert torch.isfinite(out[5]).all()  # ties at the k-th value are kept
    # explicit tie case
    row = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.5, 2.0]])
    out = ops.top_k_top_p_min_p(row, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert torch.isfinite(out[0]).tolist() == [True, False, True, True, False, True]


def test_off_values_change_nothing(ops):
    logits = torch.randn(3, 30, generator=_gen(13))
    out = ops.top_k_top_p_min_p(logits, torch.zeros(3, dtype=torch.int64), torch.ones(3), torch.zeros(3))
    assert torch.equal(out, logits)


def test_top_p_alone(ops):
    g = _gen(14)
    logits = torch.randn(10, 40, generator=g) * 2
    top_p = [0.0, 0.05, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.999, 1.0]
    _check_filter(ops, logits, [0] * 10, top_p, [0.0] * 10)


def test_top_p_exact_boundary(ops):
    # dyadic probabilities: every prefix sum is exact in any precision
    probs = [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125]
    perm = [3, 0, 5, 1, 4, 2]
    row = [0.0] * 6
    for j, i in enumerate(perm):
        row[i] = math.log(probs[j])
    logits = torch.tensor([row] * 5)
    assert torch.equal(logits.softmax(-1)[0].sort(descending=True).values, torch.tensor(probs))
    top_p = [0.5, 0.75, 0.875, 0.9375, 0.5 + 1e-6]
    out = ops.top_k_top_p_min_p(logits, torch.zeros(5, dtype=torch.int64), torch.tensor(top_p), torch.zeros(5))
    # reaching top_p exactly stops; the token that crosses it is kept
    expect_counts = [1, 2, 3, 4, 2]
    for b, c in enumerate(expect_counts):
        kept = torch.isfinite(out[b])
        assert int(kept.sum()) == c
        assert kept.tolist() == [perm.index(i) < c for i in range(6)]
    _check_filter(ops, logits, [0] * 5, top_p, [0.0] * 5)


def test_top_p_boundary_at_float32_prefix_mass(ops):
    """top_p equal to the float32 prefix mass of the j+1 most likely tokens keeps exactly j+1."""
    g = _gen(15)
    logits = torch.randn(64, 20, generator=g)
    sorted_probs = logits.softmax(-1).sort(dim=-1, descending=True).values
    mass = sorted_probs.cumsum(-1)
    j = torch.randint(0, 18, (64, ), generator=g)
    top_p = mass.gather(1, j[:, None])[:, 0]
    out = ops.top_k_top_p_min_p(logits, torch.zeros(64, dtype=torch.int64), top_p, torch.zeros(64))
    assert torch.isfinite(out).sum(-1).tolist() == (j + 1).tolist()


def test_min_p_alone(ops):
    g = _gen(16)
    logits = torch.randn(6, 30, generator=g) * 2
    min_p = [0.01, 0.1, 0.3, 0.6, 0.99, 1.0]
    out = _check_filter(ops, logits, [0] * 6, [1.0] * 6, min_p)
    assert int(torch.isfinite(out[5]).sum()) == 1  # min_p = 1 keeps the argmax only


def test_filters_combined(ops):
    g = _gen(17)
    b = 24
    logits = torch.randn(b, 50, generator=g) * 2
    logits[3, :10] = float('-inf')  # already masked tokens
    rnd = random.Random(17)
    top_k = [rnd.choice([0, 1, 3, 10, 40]) for _ in range(b)]
    top_p = [rnd.choice([1.0, 0.2, 0.6, 0.9]) for _ in range(b)]
    min_p = [rnd.choice([0.0, 0.05, 0.3]) for _ in range(b)]
    top_k[:4], top_p[:4], min_p[:4] = [5, 0, 8, 20], [0.7, 0.5, 0.9, 0.0], [0.2, 0.1, 0.0, 0.5]
    _check_filter(ops, logits, top_k, top_p, min_p)


def test_sample_is_exponential_race(ops):
    g = _gen(18)
    logits = torch.randn(16, 33, generator=g)
    seeds = torch.randint(0, 2**31, (16, ), generator=g)
    offsets = torch.randint(0, 1000, (16, ), generator=g)
    tok = ops.sample(logits, seeds, offsets)
    assert tok.dtype == torch.int64 and tok.shape == (16, )
    for b in range(16):
        u = rng.uniform(seeds[b:b + 1], offsets[b:b + 1], 33)[0].double()
        p = logits[b].double().softmax(-1)
        assert int(tok[b]) == int((p / -u.log()).argmax())


def test_sample_independent_of_batch(ops):
    g = _gen(19)
    b = 12
    logits = torch.randn(b, 64, generator=g)
    seeds = torch.randint(0, 2**40, (b, ), generator=g)
    offsets = torch.randint(0, 500, (b, ), generator=g)
    full = ops.sample(logits, seeds, offsets)
    for i in range(b):
        assert ops.sample(logits[i:i + 1], seeds[i:i + 1], offsets[i:i + 1]).item() == full[i].item()
    perm = torch.randperm(b, generator=g)
    assert torch.equal(ops.sample(logits[perm], seeds[perm], offsets[perm]), full[perm])
    # extra rows around them change nothing
    extra = torch.randn(5, 64, generator=g)
    big = torch.cat([extra[:2], logits, extra[2:]])
    s = torch.cat([torch.tensor([1, 2]), seeds, torch.tensor([3, 4, 5])])
    o = torch.cat([torch.tensor([9, 9]), offsets, torch.tensor([0, 1, 2])])
    assert torch.equal(ops.sample(big, s, o)[2:2 + b], full)


def test_sample_offsets_and_seeds_differ(ops):
    logits = torch.zeros(1, 1000).repeat(200, 1) + torch.randn(1, 1000, generator=_gen(20)) * 0.01
    offs = ops.sample(logits, torch.full((200, ), 1234), torch.arange(200))
    assert len(set(offs.tolist())) > 170
    seeds = ops.sample(logits, torch.arange(200), torch.zeros(200, dtype=torch.int64))
    assert len(set(seeds.tolist())) > 170
    # and the same (seed, offset) repeats
    assert torch.equal(ops.sample(logits, torch.full((200, ), 1234), torch.arange(200)), offs)


@pytest.mark.parametrize('seed', [0, 987654321])
def test_sample_distribution(ops, seed):
    n = 20000
    base = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    probs = base.double().softmax(-1)
    tok = ops.sample(base.repeat(n, 1), torch.full((n, ), seed), torch.arange(n))
    freq = torch.bincount(tok, minlength=5).double() / n
    assert (freq - probs).abs().max() < 0.02, (freq, probs)


def test_sample_never_draws_masked(ops):
    g = _gen(21)
    n, v = 4000, 16
    logits = torch.randn(n, v, generator=g) * 3
    mask = torch.rand(n, v, generator=g) < 0.6
    mask[torch.arange(n), torch.randint(0, v, (n, ), generator=g)] = False  # at least one allowed
    logits[mask] = float('-inf')
    tok = ops.sample(logits, torch.randint(0, 2**32, (n, ), generator=g), torch.arange(n))
    assert not mask[torch.arange(n), tok].any()


def test_sample_masked_token_at_top_uniform_bucket(ops):
    """(seed 4, offset 0, token 23329) hashes to the largest bucket of u; it must
    still be < 1 (u == 1 gave -log(u) == 0, and 0 / 0 = NaN won the argmax)."""
    v = 23330
    u = rng.uniform(torch.tensor([4]), torch.tensor([0]), v)
    assert u[0, -1] < 1.0 and u[0, -1] == u.max()
    logits = torch.randn(1, v, generator=_gen(22))
    logits[0, -1] = float('-inf')
    assert ops.sample(logits, torch.tensor([4]), torch.tensor([0])).item() != v - 1


# ------------------------------------------------------------------- rng
def test_mul32_matches_python_ints():
    rnd = random.Random(23)
    xs = [0, 1, 0xFFFF, 0x10000, 0xFFFFFFFF, 0x80000000] + [rnd.getrandbits(32) for _ in range(2000)]
    x = torch.tensor(xs, dtype=torch.int64)
    for c in [rng._K1, rng._K2, rng._GOLDEN, 0xFFFFFFFF, 1, rnd.getrandbits(32)]:
        got = rng._mul32(x, c).tolist()
        assert got == [(xi * c) % 2**32 for xi in xs]


def test_uniform_range_moments_reproducible():
    seeds = torch.tensor([0, 1, 2**31, 2**32 - 1, 123456789, -5, 7, 42])
    offsets = torch.tensor([0, 1, 2, 3, 10**6, 5, 2**32 - 1, 0])
    u = rng.uniform(seeds, offsets, 8192)
    assert u.dtype == torch.float32 and u.shape == (8, 8192)
    assert (u > 0).all() and (u < 1).all()
    ud = u.double()
    assert abs(ud.mean().item() - 0.5) < 0.005
    assert abs(ud.var().item() - 1 / 12) < 0.002
    # no row is a copy of another, and histogram is flat
    assert len({tuple(r[:16].tolist()) for r in u}) == 8
    hist = torch.histc(ud, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.005
    assert torch.equal(u, rng.uniform(seeds.clone(), offsets.clone(), 8192))
    # a row depends only on its own (seed, offset)
    assert torch.equal(rng.uniform(seeds[3:4], offsets[3:4], 8192)[0], u[3])
    assert torch.equal(rng.uniform(seeds, offsets, 100), u[:, :100])
