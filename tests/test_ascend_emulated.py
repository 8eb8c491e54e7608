"""The ascend device, run on tests/npu_emulation (plain-torch emulation of the torch_npu functions it calls,
on CPU tensors): each emulated op against a direct computation, the conformance suite, greedy tokens equal
to the cpu device's (eager and replayed NPU graphs), start-up refusals, and ``serve api_server --device
ascend`` answering a client. Not hardware: the ops' real behaviour on an NPU is not checked here."""
import math
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from lmdeploy import devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATION = os.path.join(REPO, 'tests', 'npu_emulation')


@pytest.fixture
def npu():
    """The emulated torch_npu, active in this process for one test."""
    sys.path.insert(0, EMULATION)
    try:
        import activate
    finally:
        sys.path.remove(EMULATION)
    activate.activate()
    import torch_npu
    yield torch_npu
    activate.deactivate()


def test_without_torch_npu_ascend_is_unavailable_and_auto_skips_it():
    assert 'torch_npu' not in sys.modules and not hasattr(torch, 'npu')
    assert not devices.is_available('ascend')
    assert devices.resolve_device_type('auto') != 'ascend'
    assert devices.load_class('ascend').runtime_class.collective_backend == 'hccl'
    assert devices.load_class('cpu').runtime_class.collective_backend == 'gloo'


def test_auto_picks_ascend_only_where_an_npu_is_usable(npu, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip('cuda ranks first')
    assert devices.resolve_device_type('auto') == 'ascend'
    monkeypatch.setattr(torch.npu, 'device_count', lambda: 0)
    assert devices.resolve_device_type('auto') == 'cpu'
    monkeypatch.setenv('ASCEND_RT_VISIBLE_DEVICES', '')
    assert devices.unavailable_reason('ascend') == ("torch_npu sees no NPU (no Ascend device or driver here, or "
                                                    "ASCEND_RT_VISIBLE_DEVICES='' hides them)")


# ---------------------------------------------------------------- the emulated ops, each on its own
def test_npu_rms_norm_and_add_rms_norm(npu):
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    y, rstd = npu.npu_rms_norm(x, w, epsilon=1e-5)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(rstd[:, 0], 1 / torch.sqrt((x * x).mean(-1) + 1e-5))
    y2, _, h = npu.npu_add_rms_norm(x, r, w, epsilon=1e-5)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y2, (x + r) / torch.sqrt(((x + r) ** 2).mean(-1, keepdim=True) + 1e-5) * w)


def test_npu_rotary_mul_half_mode(npu):
    x = torch.randn(1, 6, 3, 8)
    ang = torch.rand(1, 6, 1, 4) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    got = npu.npu_rotary_mul(x, cos, sin)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.exp(1j * ang)  # pairs (i, i + D/2) rotated
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], -1))
    with pytest.raises(RuntimeError):
        npu.npu_rotary_mul(x[0], cos[0], sin[0])  # 3-D: refused, as documented


def test_npu_swiglu(npu):
    x = torch.randn(4, 2 * 24)
    a, b = x[:, :24], x[:, 24:]
    torch.testing.assert_close(npu.npu_swiglu(x, dim=-1), a * torch.sigmoid(a) * b)


def test_npu_gelu_erf_and_tanh(npu):
    x = torch.randn(4, 24) * 3
    torch.testing.assert_close(npu.npu_gelu(x), 0.5 * x * (1 + torch.erf(x / 2**0.5)))
    tanh = 0.5 * x * (1 + torch.tanh((2 / torch.pi)**0.5 * (x + 0.044715 * x**3)))
    torch.testing.assert_close(npu.npu_gelu(x, approximate='tanh'), tanh)
    with pytest.raises(RuntimeError):
        npu.npu_gelu(x, approximate='sigmoid')


def test_npu_scatter_nd_update_writes_rows_in_place(npu):
    cache = torch.randn(12, 2, 4)
    before = cache.clone()
    idx = torch.randperm(12)[:5]
    rows = torch.randn(5, 2, 4)
    out = npu.npu_scatter_nd_update_(cache, idx[:, None], rows)
    assert out is cache
    want = before.clone()
    want[idx] = rows
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError):
        npu.npu_scatter_nd_update_(cache, torch.tensor([[12]]), rows[:1])


def _paged(kv_lens, hkv, d, s, num_blocks=12):
    """Random K/V per sequence in shuffled blocks [N, S, Hkv * D] and their int32 block table."""
    perm = torch.randperm(num_blocks).tolist()
    width = max(-(-n // s) for n in kv_lens)
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    kc, vc = torch.randn(num_blocks, s, hkv * d), torch.randn(num_blocks, s, hkv * d)
    ks, vs = [], []
    for b, n in enumerate(kv_lens):
        blocks = [perm.pop() for _ in range(-(-n // s))]
        table[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        ks.append(kc[blocks].reshape(-1, hkv, d)[:n])
        vs.append(vc[blocks].reshape(-1, hkv, d)[:n])
    return kc, vc, table, ks, vs


def _explicit_attention(q, k, v, scale, visible):
    """q [H, D] of one query, k / v [L, Hkv, D]: softmax(q K^T) V over the first ``visible`` keys."""
    group = q.shape[0] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[0]):
        kh, vh = k[:visible, h // group], v[:visible, h // group]
        out[h] = torch.softmax(kh @ q[h] * scale, 0) @ vh
    return out


def test_npu_fused_infer_attention_score_tnd_paged_causal(npu):
    h, hkv, d, s = 4, 2, 16, 4
    q_lens, kv_lens = [3, 1, 5], [7, 6, 5]  # a continued prefix, a decode row, a fresh prompt
    kc, vc, table, ks, vs = _paged(kv_lens, hkv, d, s)
    q = torch.randn(sum(q_lens), h, d)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    ends = [sum(q_lens[:i + 1]) for i in range(3)]
    out, _ = npu.npu_fused_infer_attention_score(q, kc, vc, atten_mask=mask, actual_seq_lengths=ends,
                                                 actual_seq_lengths_kv=kv_lens, block_table=table, num_heads=h,
                                                 scale=0.3, input_layout='TND', num_key_value_heads=hkv,
                                                 sparse_mode=3, block_size=s)
    start = 0
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        for i in range(ql):
            want = _explicit_attention(q[start + i], ks[b], vs[b], 0.3, kl - ql + i + 1)
            torch.testing.assert_close(out[start + i], want)
        start += ql
    with pytest.raises(RuntimeError, match='host ints'):  # lengths are host lists, not tensors
        npu.npu_fused_infer_attention_score(q, kc, vc, atten_mask=mask, actual_seq_lengths=torch.tensor(ends),
                                            actual_seq_lengths_kv=kv_lens, block_table=table, num_heads=h,
                                            input_layout='TND', num_key_value_heads=hkv, sparse_mode=3,
                                            block_size=s)


def test_npu_graph_replays_with_updated_lengths_only(npu):
    """A recorded fused attention keeps its host lengths until NPUGraph.update replaces them; aten work
    around it replays on the recorded tensors; a host read inside a capture fails."""
    h, hkv, d, s = 2, 1, 8, 4
    kc, vc, table, ks, vs = _paged([9, 9], hkv, d, s)
    q = torch.randn(2, h, d)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    kw = dict(atten_mask=mask, actual_seq_lengths=[1, 2], block_table=table, num_heads=h, scale=0.5,
              input_layout='TND', num_key_value_heads=hkv, sparse_mode=3, block_size=s)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out = npu.npu_fused_infer_attention_score(q, kc, vc, actual_seq_lengths_kv=[3, 4], **kw)[0] * 2
        with pytest.raises(RuntimeError, match='captured'):
            q.tolist()

    def want(lens):
        return torch.stack([_explicit_attention(q[b], ks[b], vs[b], 0.5, lens[b]) for b in range(2)]) * 2

    q.copy_(torch.randn(2, h, d))  # new inputs in the static buffer
    g.replay()
    torch.testing.assert_close(out, want([3, 4]))
    g.update(cpu_update_input=[{'actual_seq_lengths_kv': [9, 5]}])
    g.replay()
    torch.testing.assert_close(out, want([9, 5]))


def test_npu_scatter_nd_update_writes_int8_rows_and_per_head_scalars(npu):
    """int8 rows (documented from torch_npu 7.0.0 on A2) and, with [T, Hkv, 3] index triples into
    [N, Hkv, S], one scalar per (token, head): how the int8 cache's codes and scales are written."""
    codes = torch.zeros(6, 2, 8, dtype=torch.int8)
    rows = torch.randint(-128, 128, (3, 2, 8), dtype=torch.int8)
    npu.npu_scatter_nd_update_(codes, torch.tensor([[4], [0], [2]]), rows)
    assert torch.equal(codes[[4, 0, 2]], rows) and not codes[[1, 3, 5]].any()
    scales = torch.zeros(3, 2, 4)  # [N, Hkv, S]
    at = torch.tensor([[[1, 0, 3], [1, 1, 3]], [[2, 0, 0], [2, 1, 0]]])  # tokens at (block 1, 3), (block 2, 0)
    vals = torch.randn(2, 2)
    npu.npu_scatter_nd_update_(scales, at, vals)
    want = torch.zeros(3, 2, 4)
    want[1, :, 3], want[2, :, 0] = vals[0], vals[1]
    assert torch.equal(scales, want)
    with pytest.raises(RuntimeError, match='at least 2-D'):
        npu.npu_scatter_nd_update_(scales, torch.tensor([1, 0, 3]), vals[0, 0])
    with pytest.raises(RuntimeError, match='not supported'):
        npu.npu_scatter_nd_update_(torch.zeros(4, 2, dtype=torch.uint8), torch.tensor([[1]]),
                                   torch.zeros(1, 2, dtype=torch.uint8))


def test_npu_fused_infer_attention_score_int8_paged_per_token_head_antiquant(npu):
    """Q_S = 1 (BSND [B, 1, N, D]) over int8 blocks with key / value antiquant mode 5: each token's K / V
    per head read as (x + offset) * scale from float32 [block_num, Hkv, block_size]; against dequantizing
    the blocks first and attending directly. Mode 5 is refused where it is not documented (Q_S > 1, TND)."""
    h, hkv, d, s, n = 4, 2, 16, 4, 10
    kv_lens = [7, 1, 12]
    kc = torch.randint(-128, 128, (n, s, hkv * d), dtype=torch.int8)
    vc = torch.randint(-128, 128, (n, s, hkv * d), dtype=torch.int8)
    ks, ko, vs, vo = torch.rand(n, hkv, s) / 50, torch.randn(n, hkv, s) * 30, torch.rand(n, hkv, s) / 50, \
        torch.randn(n, hkv, s) * 30
    table = torch.tensor([[3, 8, 0], [5, 0, 0], [9, 1, 6]], dtype=torch.int32)
    q = torch.randn(3, 1, h, d)
    anti = dict(key_antiquant_scale=ks, key_antiquant_offset=ko, value_antiquant_scale=vs,
                value_antiquant_offset=vo, key_antiquant_mode=5, value_antiquant_mode=5)
    out, _ = npu.npu_fused_infer_attention_score(q, kc, vc, actual_seq_lengths_kv=kv_lens, block_table=table,
                                                 num_heads=h, scale=0.25, input_layout='BSND',
                                                 num_key_value_heads=hkv, block_size=s, **anti)
    assert out.shape == (3, 1, h, d)

    def dequantized(codes, scale, offset, blocks, length):  # [L, Hkv, D], token by token, head by head
        rows = []
        for blk in blocks:
            for j in range(s):
                x = codes[blk, j].reshape(hkv, d).float()
                rows.append(torch.stack([(x[i] + offset[blk, i, j]) * scale[blk, i, j] for i in range(hkv)]))
        return torch.stack(rows)[:length]

    for b, kl in enumerate(kv_lens):
        blocks = table[b, :-(-kl // s)].tolist()
        k, v = dequantized(kc, ks, ko, blocks, kl), dequantized(vc, vs, vo, blocks, kl)
        torch.testing.assert_close(out[b, 0], _explicit_attention(q[b, 0], k, v, 0.25, kl))
    kw = dict(actual_seq_lengths_kv=kv_lens, block_table=table, num_heads=h, scale=0.25, num_key_value_heads=hkv,
              block_size=s, **anti)
    with pytest.raises(RuntimeError, match='Q_S = 1'):  # a prompt (Q_S > 1) over a paged int8 cache
        npu.npu_fused_infer_attention_score(torch.randn(3, 2, h, d), kc, vc, input_layout='BSND', **kw)
    with pytest.raises(RuntimeError, match='Q_S = 1'):
        npu.npu_fused_infer_attention_score(q[:, 0].contiguous(), kc, vc, input_layout='TND',
                                            actual_seq_lengths=[1, 2, 3], **kw)
    with pytest.raises(RuntimeError, match='float32'):  # scales per block as (block_num, N, block_size)
        npu.npu_fused_infer_attention_score(q, kc, vc, input_layout='BSND',
                                            **{**kw, 'key_antiquant_scale': ks.transpose(1, 2).contiguous()})


# ---------------------------------------------------------------- the device
def test_conformance_suite_on_the_emulated_npu(npu):
    from lmdeploy.devices.conformance import run_self_tests
    results = run_self_tests('ascend')
    assert len(results) >= 11 and all(r.passed for r in results), [r for r in results if not r.passed]
    assert {'paged_decode_attention[int8]', 'paged_prefill_attention[int8]', 'layer:linear[awq]',
            'layer:linear[gptq]'} <= {r.op for r in results}


def test_int4_kv_quantization_is_refused_at_start_up(npu, smollm2_path):
    from lmdeploy import PytorchEngineConfig, pipeline
    with pytest.raises(ValueError, match=r"'ascend' does not implement quant_policy=4 \(int4 KV cache\).*"
                                         r"it implements \[0, 8\]"):
        pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='ascend', quant_policy=4,
                                                                  session_len=128, dtype='float32'))


def test_int8_cache_layout_and_stored_values(npu):
    """quant_policy 8: int8 codes (lmdeploy's code - 128) [N, S, Hkv, D] and float32 scale / offset
    [N, Hkv, S], such that (x + offset) * scale is lmdeploy's code * scale + zero (devices/cache.py);
    padding tokens (slot -1) write nothing."""
    from lmdeploy.devices.cache import dequantize, quantize
    ops = devices.get_device('ascend')
    spec = ops.kv_cache_spec(2, 8, 4, torch.bfloat16, 8)
    assert dict((n, (sh, dt)) for n, sh, dt in spec.tensors) == {
        'k': ((4, 2, 8), torch.int8), 'v': ((4, 2, 8), torch.int8), 'k_scale': ((2, 4), torch.float32),
        'k_offset': ((2, 4), torch.float32), 'v_scale': ((2, 4), torch.float32), 'v_offset': ((2, 4), torch.float32)}
    assert spec.bytes_per_block == 2 * 4 * 2 * 8 + 4 * 2 * 4 * 4
    cache = spec.allocate(3, ops.torch_device())
    for t in cache.tensors().values():
        t.zero_()
    k, v = torch.randn(5, 2, 8) * 3, torch.randn(5, 2, 8)
    slots = torch.tensor([9, 2, -1, 4, 11])
    ops.fill_kv_cache(k, v, cache, slots)
    for x, name in ((k, 'k'), (v, 'v')):
        codes, sz = quantize(x, 8)
        data, scale, offset = getattr(cache, name), cache.extra[f'{name}_scale'], cache.extra[f'{name}_offset']
        for i, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            blk, j = divmod(slot, 4)
            assert torch.equal(data[blk, j].int(), codes[i].int() - 128)
            assert torch.equal(scale[blk, :, j], sz[i, :, 0].float())
            got = (data[blk, j].float() + offset[blk, :, j, None]) * scale[blk, :, j, None]
            torch.testing.assert_close(got, dequantize(codes[i], sz[i]), rtol=0, atol=1e-5)
        written = torch.zeros(12, dtype=torch.bool)
        written[[9, 2, 4, 11]] = True
        assert not data.flatten(0, 1)[~written].any()  # the padding token went nowhere new


def test_int8_prefill_reads_only_its_own_blocks(npu):
    """A prompt over the int8 cache attends over its sequences' blocks, dequantized into a temporary: other
    blocks (here made unreadable, NaN scales) are never read, so the temporary is the step's size."""
    from lmdeploy.devices.cache import dequantize, quantize
    ops = devices.get_device('ascend')
    s, hkv, d, h = 4, 2, 16, 4
    cache = ops.kv_cache_spec(hkv, d, s, torch.float32, 8).allocate(20, ops.torch_device())
    for name in ('k_scale', 'v_scale'):
        cache.extra[name].fill_(float('nan'))
    kv_lens, q_lens = [6, 3], [2, 3]
    table = torch.tensor([[7, 13], [2, 0]], dtype=torch.int32)
    k, v = torch.randn(9, hkv, d), torch.randn(9, hkv, d)
    slots = torch.tensor([7 * s + j for j in range(4)] + [13 * s, 13 * s + 1] + [2 * s + j for j in range(3)])
    ops.fill_kv_cache(k, v, cache, slots)
    q = torch.randn(5, h, d)
    i32 = dict(dtype=torch.int32)
    out = ops.paged_prefill_attention(q, cache, table, torch.tensor([0, 2], **i32), torch.tensor(q_lens, **i32),
                                      torch.tensor(kv_lens, **i32), 0.3, 3, 6)
    kd, vd = dequantize(*quantize(k, 8)), dequantize(*quantize(v, 8))
    ctx = [(kd[:6], vd[:6]), (kd[6:], vd[6:])]
    starts = [0, 2]
    for b in range(2):
        for i in range(q_lens[b]):
            want = _explicit_attention(q[starts[b] + i], *ctx[b], 0.3, kv_lens[b] - q_lens[b] + i + 1)
            torch.testing.assert_close(out[starts[b] + i], want)


@pytest.fixture(scope='module')
def cpu_tokens(smollm2_path):
    from lmdeploy import PytorchEngineConfig, pipeline
    pipe = pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='cpu', session_len=256,
                                                                     dtype='float32', max_batch_size=4))
    try:
        return _generate(pipe)
    finally:
        pipe.close()


PROMPTS = ['What is the capital of France?', 'Count to five.', 'Name a colour.']


def _generate(pipe, margins=None):
    """Greedy tokens of PROMPTS, then seeded samples (top-k, top-p, temperature: the sampling ops on the
    device) of the first two. ``margins``: a list that gets, per greedy sequence and step, the top logit's
    lead over the runner-up."""
    from lmdeploy import GenerationConfig
    results = pipe(PROMPTS, GenerationConfig(max_new_tokens=8, do_sample=False,
                                             output_logits='generation' if margins is not None else None))
    greedy = [r.token_ids for r in results]
    for r in results if margins is not None else ():
        top2 = r.logits.float().topk(2, dim=-1).values
        margins.append((top2[:, 0] - top2[:, 1]).tolist())
    sampled = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=20, top_p=0.9, temperature=0.8,
                               random_seed=7)
    return greedy + [r.token_ids for r in pipe(PROMPTS[:2], sampled)]


@pytest.mark.parametrize('eager', [True, False], ids=['eager', 'graphs'])
def test_greedy_tokens_match_the_cpu_device(npu, smollm2_path, cpu_tokens, eager, monkeypatch):
    from lmdeploy import PytorchEngineConfig, pipeline
    replays = []
    real_replay = torch.npu.NPUGraph.replay
    monkeypatch.setattr(torch.npu.NPUGraph, 'replay', lambda g: (replays.append(g), real_replay(g))[1])
    pipe = pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='ascend', session_len=256,
                                                                     dtype='float32', max_batch_size=4,
                                                                     eager_mode=eager))
    try:
        assert pipe.engine.device.name == 'ascend'
        got = _generate(pipe)
        stats = pipe.engine.stats()
    finally:
        pipe.close()
    assert got == cpu_tokens
    assert stats.extra['decode_steps'] > 0 and stats.extra['decode_device_seconds'] > 0  # NPU events time steps
    assert (len(replays) > 0) == (not eager)  # graph mode decodes through replays, eager mode never records


@pytest.fixture(scope='module')
def cpu_int8_tokens(smollm2_path):
    from lmdeploy import PytorchEngineConfig, pipeline
    pipe = pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='cpu', session_len=256,
                                                                     dtype='float32', max_batch_size=4,
                                                                     quant_policy=8))
    try:
        margins = []  # of the same greedy run whose tokens are compared
        return _generate(pipe, margins), margins
    finally:
        pipe.close()


@pytest.mark.parametrize('eager', [True, False], ids=['eager', 'graphs'])
def test_int8_kv_cache_tokens_match_the_cpu_device(npu, smollm2_path, cpu_int8_tokens, eager, monkeypatch):
    """quant_policy=8 on the emulated NPU (prompts over dequantized own blocks, decode steps through the
    fused attention's int8 antiquant, replayed graphs too): the cpu device's quant_policy=8 tokens. The two
    round scales differently (float32 here, float16 on the cpu), which moves logits by ~1e-2: a greedy
    sequence may part from the cpu's only where the cpu's top two logits were that close (CI saw one part at
    its first token, 0.022 apart), and is compared up to there."""
    from lmdeploy import PytorchEngineConfig, pipeline
    replays, antiquant_calls = [], []
    real_replay = torch.npu.NPUGraph.replay
    monkeypatch.setattr(torch.npu.NPUGraph, 'replay', lambda g: (replays.append(g), real_replay(g))[1])
    fused = npu.npu_fused_infer_attention_score

    def counting(*args, **kwargs):
        antiquant_calls.append(kwargs.get('key_antiquant_mode'))
        return fused(*args, **kwargs)
    monkeypatch.setattr(npu, 'npu_fused_infer_attention_score', counting)
    pipe = pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='ascend', session_len=256,
                                                                     dtype='float32', max_batch_size=4,
                                                                     eager_mode=eager, quant_policy=8))
    try:
        assert pipe.engine.runner.kv_caches[0].k.dtype == torch.int8
        got = _generate(pipe)
    finally:
        pipe.close()
    want, margins = cpu_int8_tokens
    n = len(PROMPTS)
    assert got[n:] == want[n:]  # the seeded samples
    compared = 0
    for g, w, m in zip(got[:n], want[:n], margins):
        part = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if part is None:
            assert g == w
            compared += len(w)
        else:
            assert m[part] < 0.05, f'parted at step {part}, where the cpu top logit led by {m[part]:.3f}'
            compared += part
    assert compared >= len(sum(want[:n], [])) // 2  # most of it compared
    assert (len(replays) > 0) == (not eager)
    assert 5 in antiquant_calls  # decode steps read the int8 cache through antiquant mode 5


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_api_server_on_the_emulated_npu_answers_a_client(smollm2_path, tmp_path):
    """``lmdeploy serve api_server --device ascend`` in a subprocess whose interpreter loads the emulation
    (tests/npu_emulation/sitecustomize.py), its engine process too."""
    import httpx
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([EMULATION, REPO]))
    log = open(tmp_path / 'server.log', 'w')
    proc = subprocess.Popen([sys.executable, '-m', 'lmdeploy', 'serve', 'api_server', smollm2_path, '--device',
                             'ascend', '--server-port', str(port), '--server-name', '127.0.0.1', '--session-len',
                             '256', '--dtype', 'float32', '--max-batch-size', '2'],  # graph mode, the default
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, (tmp_path / 'server.log').read_text()[-3000:]
            try:
                if httpx.get(f'http://127.0.0.1:{port}/health', timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, (tmp_path / 'server.log').read_text()[-3000:]
            time.sleep(0.5)
        model = httpx.get(f'http://127.0.0.1:{port}/v1/models', timeout=10).json()['data'][0]['id']
        r = httpx.post(f'http://127.0.0.1:{port}/v1/chat/completions', timeout=120, json=dict(
            model=model, messages=[{'role': 'user', 'content': 'What is the capital of France?'}], max_tokens=8,
            temperature=0))
        assert r.status_code == 200, r.text
        assert 'Paris' in r.json()['choices'][0]['message']['content']
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_scale_of_the_decode_attention_is_the_callers(npu):
    """The device passes the layer's scale through (not 1/sqrt(D) of its own)."""
    ops = devices.get_device('ascend')
    spec = ops.kv_cache_spec(1, 8, 4, torch.float32)
    cache = spec.allocate(4, ops.torch_device())
    k, v = torch.randn(6, 1, 8), torch.randn(6, 1, 8)
    ops.fill_kv_cache(k, v, cache, torch.arange(6))
    table = torch.arange(4, dtype=torch.int32)[None]
    q = torch.randn(1, 2, 8)
    for scale in (0.1, 1 / math.sqrt(8), 2.0):
        got = ops.paged_decode_attention(q, cache, table, torch.tensor([6]), scale, 6)
        want = torch.stack([_explicit_attention(q[0], k, v, scale, 6)])
        torch.testing.assert_close(got, want)


def test_check_env_reports_the_emulated_npu_and_runs_the_suite_on_it():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([EMULATION, REPO]))
    r = subprocess.run([sys.executable, '-m', 'lmdeploy', 'check_env'], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert any(line.split()[:2] == ['NPU', 'available'] and line.split()[-1] == 'True' for line in lines), r.stdout
    assert any('emulation of torch_npu' in line for line in lines), r.stdout
    assert any(line.split()[:2] == ['ascend', 'available'] for line in lines), r.stdout
    passed = [line for line in lines if line.split()[:1] == ['ascend'] and 'PASS' in line]
    assert len(passed) >= 9, r.stdout


def test_chat_on_the_emulated_npu(smollm2_path):
    """``lmdeploy chat MODEL --device ascend`` answers a turn (the REPL driven through a terminal)."""
    pexpect = pytest.importorskip('pexpect')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([EMULATION, REPO]))
    argv = ['-m', 'lmdeploy', 'chat', smollm2_path, '--device', 'ascend', '--dtype', 'float32', '--session-len', '256',
            '--max-new-tokens', '12', '--max-batch-size', '2']
    child = pexpect.spawn(sys.executable, argv, cwd=REPO, env=env, encoding='utf-8', timeout=120, dimensions=(50, 200))
    try:
        child.expect('>>> ')
        child.sendline('What is the capital of France?')
        child.expect(r'\[session \d+ \| turn 1')
        assert 'Paris' in child.before, child.before
        child.expect('>>> ')
        child.sendline('exit')
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


# ---------------------------------------------------------------- W4A16 (AWQ / GPTQ weights)
@pytest.mark.parametrize('dtype,group', [(torch.float32, 32), (torch.bfloat16, 0), (torch.float16, 64)])
def test_npu_weight_quant_batchmatmul_int4(npu, dtype, group):
    """x @ ((w + offset) * scale) with int4 weights through npu_convert_weight_to_int4pack, a scale and
    offset per group of input rows (0: per channel), against the formula computed directly."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    m, k, n = 5, 128, 48
    w = torch.randint(-8, 8, (k, n), generator=g, dtype=torch.int32)
    groups = k // group if group else 1
    scale = (torch.rand(groups, n, generator=g) / 10 + 0.01).to(dtype)
    offset = torch.randint(-7, 9, (groups, n), generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    got = npu.npu_weight_quant_batchmatmul(x, npu.npu_convert_weight_to_int4pack(w), scale, offset,
                                           antiquant_group_size=group)
    rows = torch.arange(k) // group if group else torch.zeros(k, dtype=torch.long)
    want = x.double() @ ((w.double() + offset.double()[rows]) * scale.double()[rows])
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert float((got.double() - want).abs().max()) <= tol * float(want.abs().max())
    with pytest.raises(RuntimeError, match='antiquant_scale must be'):
        npu.npu_weight_quant_batchmatmul(x, npu.npu_convert_weight_to_int4pack(w), scale[:1].repeat(3, 1),
                                         offset, antiquant_group_size=group or 64)
    with pytest.raises(RuntimeError, match='int4 range'):
        npu.npu_convert_weight_to_int4pack(w + 8)


def test_awq_and_gptq_layers_run_through_the_npu_op(npu):
    """The device's AWQ / GPTQ layers pack their weights for npu_weight_quant_batchmatmul (GPTQ act-order:
    input columns permuted so that each group is a run) and give the reference's outputs."""
    from torch import nn

    from lmdeploy.devices import get_device
    from lmdeploy.devices.ascend.w4a16 import AscendAwqLinear, AscendGptqLinear
    from lmdeploy.devices.quant_formats import AwqLinear, GptqLinear
    from lmdeploy.devices.reference import ReferenceOps
    ops = get_device('ascend')
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    k, n, group = 128, 64, 32
    cases = [(AwqLinear, {'quant_method': 'awq', 'bits': 4, 'group_size': group, 'version': 'gemm'}, None),
             (GptqLinear, {'quant_method': 'gptq', 'bits': 4, 'group_size': group, 'desc_act': True}, 'act'),
             (GptqLinear, {'quant_method': 'gptq', 'bits': 4, 'group_size': -1}, None)]
    for ref_cls, config, order in cases:
        mine, ref = nn.Module(), nn.Module()
        impl, ref_impl = ops.layer_impl('linear', ref_cls.format, config), ref_cls(ReferenceOps(), config)
        assert isinstance(impl, (AscendAwqLinear, AscendGptqLinear))
        impl.create_weights(mine, k, n, True)
        ref_impl.create_weights(ref, k, n, True)
        for name, p in ref.named_parameters():
            if name == 'g_idx':  # act-order: every group has `group` columns, in a random order
                value = (torch.randperm(k, generator=g) // group).to(torch.int32) if order else \
                    torch.zeros(k, dtype=torch.int32)
            elif p.dtype == torch.int32:
                value = torch.randint(-2**31, 2**31 - 1, p.shape, generator=g, dtype=torch.int32)
            else:
                value = torch.rand(p.shape, generator=g) / 20 + 1e-3
            getattr(mine, name).data = value.clone()
            getattr(ref, name).data = value.clone()
        impl.process_weights(mine)
        ref_impl.process_weights(ref)
        assert mine.weight_int4.dtype == torch.int32 and mine.weight_int4.shape == (k, n // 8)
        assert (mine.column_order is not None) == bool(order)
        x = torch.randn(3, k, generator=g)
        want = ref_impl.apply(ref, x)
        got = impl.apply(mine, x)
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()), ref_cls.__name__


@pytest.mark.parametrize('method,desc_act', [('awq', False), ('gptq', True)])
def test_quantized_checkpoint_decodes_as_on_the_cpu(npu, tiny_model_factory, tmp_path, method, desc_act):
    """A tiny AWQ / GPTQ (act-order) checkpoint: greedy tokens on the emulated NPU (float32, eager, through
    npu_weight_quant_batchmatmul) equal the cpu device's (the reference's dequantize-and-matmul)."""
    from engine_utils import generate_all, greedy
    from test_quant_formats import _checkpoint

    from lmdeploy.engine.engine import Engine
    from lmdeploy.messages import PytorchEngineConfig
    quant = str(tmp_path / method)
    _checkpoint(tiny_model_factory('llama'), quant, str(tmp_path / 'dense'), method, 32, desc_act=desc_act)
    prompts = [[30, 400, 5000, 77], [900, 12, 31, 3000, 45, 6]]
    tokens = {}
    for device in ('cpu', 'ascend'):
        eng = Engine(quant, PytorchEngineConfig(device_type=device, dtype='float32', session_len=128,
                                                eager_mode=True))
        try:
            if device == 'ascend':
                layer = eng.runner.model.model.layers[0].self_attn.qkv_proj
                assert type(layer.impl).__name__.startswith('Ascend') and layer.impl.fused
            tokens[device] = generate_all(eng, prompts, greedy(12))
        finally:
            eng.close()
    assert tokens['ascend'] == tokens['cpu']
