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
    assert devices.load_class('ascend').collective_backend == 'hccl'
    assert devices.load_class('cpu').collective_backend == 'gloo'


def test_auto_picks_ascend_only_where_an_npu_is_usable(npu, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip('cuda ranks first')
    assert devices.resolve_device_type('auto') == 'ascend'
    monkeypatch.setattr(torch.npu, 'device_count', lambda: 0)
    assert devices.resolve_device_type('auto') == 'cpu'


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


# ---------------------------------------------------------------- the device
def test_conformance_suite_on_the_emulated_npu(npu):
    from lmdeploy.devices.conformance import run_self_tests
    results = run_self_tests('ascend')
    assert len(results) >= 9 and all(r.passed for r in results), [r for r in results if not r.passed]


def test_unsupported_kv_quantization_is_refused_at_start_up(npu, smollm2_path):
    from lmdeploy import PytorchEngineConfig, pipeline
    for policy in (4, 8):
        with pytest.raises(ValueError, match=f"'ascend' does not implement quant_policy={policy}"):
            pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='ascend', quant_policy=policy,
                                                                      session_len=128, dtype='float32'))


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


def _generate(pipe):
    """Greedy tokens of PROMPTS, then seeded samples (top-k, top-p, temperature: the sampling ops on the
    device) of the first two."""
    from lmdeploy import GenerationConfig
    greedy = [r.token_ids for r in pipe(PROMPTS, GenerationConfig(max_new_tokens=8, do_sample=False))]
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
