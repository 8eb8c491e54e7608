"""Where a cache's bytes lie is the device's choice (devices/cache.py): blocks stored token-major or head-major
mean the same values, so every op, the conformance suite and the engine must give the same results over
either. (The cuda kernels over head-major caches: tests/test_cuda_kernels.py and test_cuda_compiled.py.)"""
import dataclasses
import random

import pytest
import torch
from engine_utils import assert_engine_clean, generate_all, greedy

from lmdeploy.devices.cache import row_strides, standard_spec
from lmdeploy.devices.conformance import run_self_tests
from lmdeploy.devices.cpu import CpuOps
from lmdeploy.engine.engine import Engine
from lmdeploy.messages import PytorchEngineConfig


class HeadMajorCpu(CpuOps):
    """The cpu device with every cache stored head-major."""

    def kv_cache_spec(self, *args, **kwargs):
        return dataclasses.replace(super().kv_cache_spec(*args, **kwargs), head_major=True)


@pytest.mark.parametrize('policy', [0, 8, 4])
def test_head_major_blocks_keep_each_heads_tokens_in_one_run(policy):
    """Same shapes (as views), bytes and values as the token-major cache; in memory a block is [Hkv, S, ...]."""
    s, hkv, d = 4, 3, 16
    token = standard_spec(hkv, d, s, torch.float32, policy)
    head = standard_spec(hkv, d, s, torch.float32, policy, head_major=True)
    assert head.bytes_per_block == token.bytes_per_block
    a, b = token.allocate(5, 'cpu'), head.allocate(5, 'cpu')
    assert row_strides(a.k, a.v, a.k_scale_zero, a.v_scale_zero) == (hkv * s, hkv, 1)
    assert row_strides(b.k, b.v, b.k_scale_zero, b.v_scale_zero) == (hkv * s, 1, s)
    assert (a.rows, b.rows) == ((hkv * s, hkv, 1), (hkv * s, 1, s))  # what the ops read, worked out once
    for name, t in b.tensors().items():
        assert t.shape == a.tensors()[name].shape
        assert t[2, :, 1].is_contiguous()  # block 2, KV head 1: its S tokens one after another
    ops = CpuOps()
    k, v = torch.randn(11, hkv, d), torch.randn(11, hkv, d)
    slots = torch.randperm(5 * s)[:11]
    for c in (a, b):
        for t in c.tensors().values():
            t.zero_()
        ops.fill_kv_cache(k, v, c, slots)
    for name, t in a.tensors().items():
        assert torch.equal(b.tensors()[name], t), name


def test_row_strides_refuse_caches_laid_out_apart():
    a = standard_spec(2, 8, 4, torch.float16, 8).allocate(3, 'cpu')
    b = standard_spec(2, 8, 4, torch.float16, 8, head_major=True).allocate(3, 'cpu')
    with pytest.raises(ValueError, match='one layout'):
        row_strides(a.k, b.v)
    with pytest.raises(ValueError, match='one layout'):
        row_strides(b.k, b.v, a.k_scale_zero, a.v_scale_zero)


def test_the_cuda_device_stores_quantized_caches_head_major():
    from lmdeploy.devices.cuda.ops import CudaOps
    ops = CudaOps(num_sms=132)
    for policy in (0, 8, 4):
        spec = ops.kv_cache_spec(8, 128, 64, torch.bfloat16, policy)
        assert spec.head_major == (policy != 0)
        assert spec.tensors == standard_spec(8, 128, 64, torch.bfloat16, policy).tensors


def test_the_conformance_suite_passes_over_head_major_caches():
    """The suite's cache checks (fill, rotary + fill, paged decode and prefill attention, every policy) read
    a device's cache through its views: the reference ops over head-major blocks pass them all."""
    results = run_self_tests('cpu', ops=HeadMajorCpu())
    assert results and all(r.passed for r in results), [r for r in results if not r.passed]
    assert any('quant' in r.op or 'int' in r.op for r in results), [r.op for r in results]


@pytest.mark.parametrize('policy', [0, 8, 4])
def test_the_engine_gives_the_same_tokens_over_head_major_blocks(tiny_model_factory, policy, monkeypatch):
    """Prefix-cache hits, chunked prefill and preemption move no bytes of a cache by hand: over head-major
    blocks the engine gives exactly the tokens it gives over token-major ones."""
    import lmdeploy.engine.engine as engine_module
    model = tiny_model_factory('llama')
    rng = random.Random(policy)
    shared = [rng.randrange(20, 1000) for _ in range(12)]  # a prefix for the prefix cache to hit
    prompts = [shared + [rng.randrange(20, 1000) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    params = greedy(10)
    runs = {}
    for layout in ('token', 'head'):
        if layout == 'head':
            monkeypatch.setattr(engine_module, 'get_device', lambda device_type='auto': HeadMajorCpu())
        eng = Engine(model, PytorchEngineConfig(device_type='cpu', block_size=4, session_len=128, quant_policy=policy,
                                                enable_prefix_caching=True, max_prefill_token_num=16,
                                                num_gpu_blocks=16, max_batch_size=8))
        try:
            cache = eng.runner.kv_caches[0]
            assert row_strides(cache.k, cache.v)[1:] == ((1, 4) if layout == 'head' else (cache.k.shape[2], 1))
            runs[layout] = generate_all(eng, prompts, params) + generate_all(eng, prompts, params)
            assert eng.stats().num_prefix_hit_tokens > 0 and eng.stats().num_preemptions > 0
            assert_engine_clean(eng)
        finally:
            eng.close()
    assert runs['head'] == runs['token']
