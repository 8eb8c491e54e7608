"""The quantized KV cache (quant_policy 8 / 4; devices/cache.py defines it):
the quantization math, the engine with a quantized cache (prefix caching,
chunked prefill, preemption and interactive sessions unchanged), refusals,
and quality on the real model."""
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from background import BACKGROUND_POPEN, Background, lower_priority
from engine_utils import assert_engine_clean, generate_all, greedy, submit
from helpers import benchmark_module

from lmdeploy.devices.cache import (QUANT_POLICIES, dequantize, hadamard, pack_int4, quantize, rotates_k,
                                    standard_spec, unpack_int4)
from lmdeploy.devices.reference import ReferenceOps
from lmdeploy.engine.engine import Engine
from lmdeploy.messages import PytorchEngineConfig


# ------------------------------------------------------------------ the math
@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_is_asymmetric_per_row_and_within_half_a_step(bits, dtype):
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 8 + 3).to(dtype)
    codes, sz = quantize(x, bits)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= (1 << bits) - 1 and sz.shape == (50, 3, 2)
    assert sz.dtype == torch.float16
    # the row's minimum is the zero (to float16), its maximum the top code
    assert torch.equal(sz[..., 1], x.float().amin(-1).half())
    assert (codes.amin(-1) == 0).all() and (codes.amax(-1) == (1 << bits) - 1).all()
    back = dequantize(codes, sz)
    scale = sz[..., 0:1].float()
    assert ((back - x.float()).abs() <= scale / 2 + 1e-3 * x.float().abs().amax(-1, keepdim=True)).all()


def test_constant_rows_and_int4_packing():
    x = torch.full((2, 4, 8), 1.5)
    codes, sz = quantize(x, 4)
    assert (codes == 0).all() and torch.equal(dequantize(codes, sz), x)
    c = torch.randint(0, 16, (5, 2, 8), dtype=torch.uint8)
    packed = pack_int4(c)
    assert packed.shape == (5, 2, 4) and torch.equal(unpack_int4(packed), c)
    assert torch.equal(packed[0, 0, 1] & 0xF, c[0, 0, 1]) and torch.equal(packed[0, 0, 1] >> 4, c[0, 0, 5])


def test_int4_keeps_k_in_the_hadamard_basis():
    """H is orthonormal and symmetric; with quant_policy 4 the reference stores K rotated (its dequantized
    K, rotated back, is closer to K than int4 of K itself, whose outlier channel takes most of the range)
    and V as it is; its attention, which rotates q the same way, is attention over the rotated-back K; a
    head_dim that is no power of two is left unrotated."""
    for d in (32, 64, 128):
        h = hadamard(d)
        assert torch.allclose(h @ h, torch.eye(d), atol=1e-6) and torch.equal(h, h.T)
    assert rotates_k(4, 64) and not rotates_k(8, 64) and not rotates_k(4, 80) and not rotates_k(4, 16)
    ops = ReferenceOps()
    n, hkv, d, bs = 40, 2, 64, 16
    k, v = torch.randn(n, hkv, d) * torch.rand(n, hkv, 1) * 3, torch.randn(n, hkv, d)
    k[:, :, 5] += 20  # an outlier channel, as real keys have
    caches = {p: ops.kv_cache_spec(hkv, d, bs, torch.float32, p).allocate(3, 'cpu') for p in (0, 4)}
    for c in caches.values():
        ops.fill_kv_cache(k, v, c, torch.arange(n))
    stored_k = ops._read(caches[4], 'k', torch.arange(3)).flatten(0, 1)[:n]
    stored_v = ops._read(caches[4], 'v', torch.arange(3)).flatten(0, 1)[:n]
    back = stored_k @ hadamard(d)
    codes, sz = quantize(k, 4)
    unrotated = (dequantize(codes, sz) - k).norm() / k.norm()  # ~15 %: the outlier takes most of the range
    assert (back - k).norm() / k.norm() < 0.65 * unrotated and (stored_v - v).norm() / v.norm() < 0.15
    assert (stored_k - k).norm() / k.norm() > 0.5  # (it is stored rotated)
    q = torch.randn(1, 4, d)
    got = ops.paged_decode_attention(q, caches[4], torch.tensor([[0, 1, 2]]), torch.tensor([n]), d**-0.5, n)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), back.transpose(0, 1),
                                                            stored_v.transpose(0, 1), scale=d**-0.5, enable_gqa=True)
    assert torch.allclose(got, want.transpose(0, 1), atol=1e-5)


def test_spec_bytes_and_capacity():
    """Per token and KV head of head_dim 128, K and V: 2 x 256 bytes in bf16, 2 x (128 + 4) with int8 and
    2 x (64 + 4) with int4 (the 4: a float16 scale and zero)."""
    per = {p: standard_spec(8, 128, 64, torch.bfloat16, p).bytes_per_block for p in QUANT_POLICIES}
    assert per[0] == 64 * 8 * 512 and per[8] == 64 * 8 * 264 and per[4] == 64 * 8 * 136
    assert per[0] / per[8] >= 1.9 and per[0] / per[4] >= 3.5
    with pytest.raises(ValueError, match='quant_policy'):
        standard_spec(8, 128, 64, torch.bfloat16, 2)
    with pytest.raises(ValueError, match='even'):
        standard_spec(8, 63, 64, torch.bfloat16, 4)


def test_a_device_without_a_policy_refuses_it_at_start_up(tiny_model_factory, monkeypatch):
    import lmdeploy.engine.engine as engine_module
    from lmdeploy.devices.cpu import CpuOps

    class Unquantized(CpuOps):
        name = 'unquantized'
        quant_policies = (0, )

    monkeypatch.setattr(engine_module, 'get_device', lambda device_type='auto': Unquantized())
    with pytest.raises(ValueError, match="'unquantized' does not implement quant_policy=8"):
        Engine(tiny_model_factory('llama'), PytorchEngineConfig(device_type='cpu', quant_policy=8))


# ---------------------------------------------------------------- the engine
def _prompts(n, seed):
    rng = random.Random(seed)
    shared = [rng.randrange(20, 1000) for _ in range(12)]
    return [shared + [rng.randrange(20, 1000) for _ in range(rng.randint(1, 30))] for _ in range(n)]


@pytest.mark.parametrize('policy', [8, 4])
def test_quantized_cache_gives_the_same_tokens_however_the_work_is_cut(tiny_model_factory, policy):
    """Each token's K/V is quantized once, when written, so a quantized cache holds the same values
    whether a prompt was prefilled whole or in chunks, came from the prefix cache, or was recomputed
    after a preemption: the tokens must not change."""
    model = tiny_model_factory('llama')
    prompts, params = _prompts(10, policy), greedy(12)
    runs = {}
    # 512 blocks of 4 tokens: room for all 10 sequences (at most 14 blocks each) and the prefix cache's blocks of
    # the first pass. (Left to the default, the tiny model's quantized cache is 6-11 million blocks, whose
    # bookkeeping and assert_engine_clean's walk over every block took 3-5 s an engine.) Preempting: 14 blocks,
    # as few as the longest sequence needs.
    room = dict(num_gpu_blocks=512)
    for name, kw in (('plain', room), ('chunks of 8', dict(room, max_prefill_token_num=8)),
                     ('prefix cache', dict(room, enable_prefix_caching=True)),
                     ('preempting', dict(num_gpu_blocks=14, max_batch_size=8))):
        eng = Engine(model, PytorchEngineConfig(device_type='cpu', block_size=4, session_len=128, quant_policy=policy,
                                                **kw))
        try:
            assert eng.runner.kv_caches[0].quant_policy == policy
            runs[name] = generate_all(eng, prompts, params)
            if name == 'prefix cache':
                runs['prefix cache, again'] = generate_all(eng, prompts, params)  # served from cached blocks
                assert eng.stats().num_prefix_hit_tokens > 0
            if name == 'preempting':
                assert eng.stats().num_preemptions > 0
            assert_engine_clean(eng)
        finally:
            eng.close()
    assert all(r == runs['plain'] for r in runs.values()), runs


@pytest.mark.parametrize('policy', [8, 4])
def test_interactive_sessions_keep_a_quantized_cache(tiny_model_factory, policy):
    model = tiny_model_factory('qwen3')
    eng = Engine(model, PytorchEngineConfig(device_type='cpu', block_size=4, session_len=256, quant_policy=policy,
                                            num_gpu_blocks=64))  # (the default: millions, see above)
    try:
        first = submit(eng, [5, 6, 7, 8, 9], greedy(6), session_id=1, interactive=True).wait()
        second = submit(eng, [10, 11], greedy(6), session_id=1, interactive=True).wait()
        eng.end_session(1)
        whole = submit(eng, [5, 6, 7, 8, 9] + first.token_ids + [10, 11], greedy(6)).wait()
        assert second.token_ids == whole.token_ids  # the second turn read the first's quantized cache
        assert_engine_clean(eng)
    finally:
        eng.close()


# ------------------------------------------------------------------- quality
QUALITY_POLICIES = (0, 8, 4)


def _measure_quality(policy: int) -> dict:
    """benchmark/kv_quant_quality.py's measurement of one policy (what the test below asserts on)."""
    from lmdeploy.default_model import default_model_path
    measure = benchmark_module('kv_quant_quality').measure
    return measure(default_model_path(), 'cpu', 'float32', [policy], 20480, 2048, 0, 0, 0)[policy]


class _Quality:
    """Each policy's perplexity measured in a subprocess of its own, one thread each, at the lowest priority,
    begun when collection is done (tests/background.py): about 6 CPU minutes in all, mostly done on the core
    the other tests leave idle; at the end the three share both cores evenly, finishing together."""

    def __init__(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's lmdeploy
        env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1',
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get('PYTHONPATH')])))
        self.procs = {}
        for policy in QUALITY_POLICIES:
            out, err = tempfile.TemporaryFile('w+'), tempfile.TemporaryFile('w+')
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), '--quality', str(policy)], env=env,
                                    stdout=out, stderr=err, text=True, **BACKGROUND_POPEN)
            lower_priority(proc.pid)
            self.procs[policy] = proc, out, err

    def result(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        results = {}
        for policy, (proc, out, err) in self.procs.items():
            proc.wait(max(1, deadline - time.monotonic()))
            out.seek(0)
            err.seek(0)
            lines = [line for line in out.read().splitlines() if line.startswith('quality ')]
            assert proc.returncode == 0 and lines, f'quant_policy {policy}: {err.read()[-3000:]}'
            results[policy] = json.loads(lines[-1][len('quality '):])
        return results

    def pids(self):
        return [proc.pid for proc, _, _ in self.procs.values()]

    def cancel(self):
        for proc, out, err in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
            err.close()


background = Background(serves=lambda item: getattr(item, 'originalname', None) == 'test_quality_on_the_real_model',
                        begin=lambda items: _Quality())


@pytest.fixture(scope='module')
def quality(request) -> dict:
    return background.result(request.session)


def test_quality_on_the_real_model(quality):
    """SmolLM2-135M, cpu, float32, 20,480 tokens of Python's own reference text (pydoc_data.topics) in
    windows of 2,048: perplexity with quant_policy 8 within the issue's 0.5 % of quant_policy 0, with 4
    within its 5 % (measured: 0.05 % and 4.0 %; int4 keeps K in the Hadamard basis less each layer's mean
    key, devices/cache.py; 7.1 % without the offset, 16.6 % unrotated too; benchmark/RESULTS.md)."""
    res = quality
    ppl = {p: r['ppl'] for p, r in res.items()}
    print('perplexity by quant_policy:', ppl)
    assert all(math.isfinite(v) and 1 < v < 100 for v in ppl.values())
    assert abs(ppl[8] / ppl[0] - 1) <= 0.005
    assert ppl[4] / ppl[0] - 1 <= 0.05
    assert res[8]['kv_tokens'] > 1.9 * res[0]['kv_tokens'] and res[4]['kv_tokens'] > 3.5 * res[0]['kv_tokens']


if __name__ == '__main__':
    if sys.argv[1] == '--quality':
        torch.set_num_threads(1)
        print('quality', json.dumps(_measure_quality(int(sys.argv[2]))), flush=True)
