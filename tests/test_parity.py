"""Greedy decoding on cpu/float32 equals transformers token for token.

Every tiny architecture, plus SmolLM2, under plain continuous batching,
prefix caching, chunked prefill, and a KV budget that forces preemption.
"""
import random

import pytest
from engine_utils import generate_all, greedy
from helpers import TINY_MODEL_NAMES, hf_greedy

from lmdeploy.engine.engine import Engine
from lmdeploy.messages import PytorchEngineConfig

NEW_TOKENS = 32


def make_prompts(seed: int, lengths, vocab: int = 49152, shared_prefix: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(20, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(20, vocab) for _ in range(n)] for n in lengths]


# Where the KV budget is not the point: 512 blocks, room for every prompt here with all its tokens (left to the
# default, a tiny model's cache is a million blocks or more, whose bookkeeping and invariant checks take seconds)
ROOM = 512
SCENARIOS = {
    'batched': dict(block_size=16, num_gpu_blocks=ROOM),
    'prefix_cache': dict(block_size=4, enable_prefix_caching=True, num_gpu_blocks=ROOM),
    'chunked_prefill': dict(block_size=8, max_prefill_token_num=7, num_gpu_blocks=ROOM),
    'preemption': dict(block_size=4, num_gpu_blocks=40),
    # prefill and decode in separate steps, as on devices that replay graphs
    'separate_phases': dict(block_size=8, max_prefill_token_num=16, prefill_interval=2, num_gpu_blocks=ROOM),
}


@pytest.fixture(scope='module')
def references(tiny_model_factory):
    cache = {}

    def get(name, prompts):
        key = (name, tuple(map(tuple, prompts)))
        if key not in cache:
            cache[key] = hf_greedy(tiny_model_factory(name), prompts, NEW_TOKENS)
        return cache[key]

    return get


def run_scenario(path, scenario, prompts, rounds=1):
    cfg = PytorchEngineConfig(device_type='cpu', session_len=256, **SCENARIOS[scenario])
    engine = Engine(path, cfg)
    if scenario == 'separate_phases':
        engine.scheduler.mix = False
    try:
        results = [generate_all(engine, prompts, greedy(NEW_TOKENS)) for _ in range(rounds)]
        assert engine.wait_idle()
        engine.check_invariants()
        return engine, results
    finally:
        engine.close()


@pytest.mark.parametrize('name', TINY_MODEL_NAMES)
def test_tiny_models_match_transformers(name, tiny_model_factory, references):
    prompts = make_prompts(1, [5, 23, 41, 2])
    want = references(name, prompts)
    _, (got, ) = run_scenario(tiny_model_factory(name), 'batched', prompts)
    assert got == want


@pytest.mark.parametrize('name', ['llama', 'qwen2', 'qwen3', 'llama3_rope'])
@pytest.mark.parametrize('scenario', ['prefix_cache', 'chunked_prefill', 'preemption', 'separate_phases'])
def test_engine_features_keep_parity(name, scenario, tiny_model_factory, references):
    # shared prefixes so the cache has something to reuse; several rounds reuse it again
    prompts = make_prompts(2, [3, 10, 19, 1], shared_prefix=13)
    want = references(name, prompts)
    engine, results = run_scenario(tiny_model_factory(name), scenario, prompts, rounds=2)
    for got in results:
        assert got == want
    stats = engine.stats()
    if scenario == 'prefix_cache':
        assert stats.num_prefix_hit_tokens > 0
    if scenario == 'preemption':
        assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks


def test_smollm2_matches_transformers(smollm2_path, tokenizer_prompts):
    want = hf_greedy(smollm2_path, tokenizer_prompts, NEW_TOKENS)
    for scenario in ('batched', 'chunked_prefill'):
        _, (got, ) = run_scenario(smollm2_path, scenario, tokenizer_prompts)
        assert got == want, scenario


@pytest.fixture(scope='module')
def tokenizer_prompts(smollm2_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    texts = ['Shanghai is', 'The three primary colours are', 'def fibonacci(n):\n    """Return the n-th Fibonacci',
             'Hi']
    return [tok.encode(t) for t in texts]
