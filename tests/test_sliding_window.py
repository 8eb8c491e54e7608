"""Sliding-window attention end to end: tiny random Mistral, Qwen2, Qwen3 and Phi-3 models (transformers' configs, random
weights, save_pretrained) whose window is much shorter than the prompts decode on cpu / float32 token for
token as transformers does: whole prompts, prompts prefilled in chunks that cross the window's edge, and
decodes far past it. Qwen2 and Qwen3 apply the window only from ``max_window_layers`` on (transformers'
``layer_types``), read from the saved ``layer_types`` or, without them, from ``max_window_layers``; Mistral
and Phi-3 on every layer (then blocks behind the window are given back: the last test)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from engine_utils import generate_all, greedy
from helpers import build_tiny_custom, hf_greedy, hf_logits, random_prompts

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.model_config import layer_window, load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.mistral import MistralForCausalLM
from lmdeploy.engine.models.phi3 import Phi3ForCausalLM
from lmdeploy.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from lmdeploy.messages import PytorchEngineConfig

NEW_TOKENS = 24
WINDOW = 6
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2, pad_token_id=2, rope_theta=10000.0, tie_word_embeddings=False)
SPECS = {
    'mistral': ('MistralConfig', dict(TINY, sliding_window=WINDOW)),
    # layer 0 attends fully, layer 1 within the window
    'qwen2': ('Qwen2Config', dict(TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    'qwen3': ('Qwen3Config', dict(TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                  attention_bias=False)),
    'phi3': ('Phi3Config', dict(TINY, sliding_window=WINDOW)),  # every layer, as transformers' Phi3
}


SEED = int.from_bytes(os.urandom(4), 'little')  # new prompts each run, the same for every test of the run


def _prompts():
    """Prompts of 3, 17 and 41 random tokens (the run's: transformers' answers are reused across tests)."""
    return random_prompts(SEED)


def _without_window(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, 'config.json')) as f:
        cfg = json.load(f)
    cfg.pop('layer_types', None)
    cfg['sliding_window'] = 4096  # past every sequence here: full attention
    with open(os.path.join(dst, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    return dst


@pytest.fixture(scope='module')
def models(smollm2_path, tmp_path_factory):
    root = tmp_path_factory.mktemp('sliding')
    made = {}

    def get(name):
        if name not in made:
            cls_name, kwargs = SPECS[name]
            seed = int.from_bytes(os.urandom(2), 'little')
            made[name] = build_tiny_custom(str(root / name), smollm2_path, cls_name, kwargs, seed)
        return made[name]

    return get


def _engine_tokens(path, prompts, **kw):
    cfg = dict(device_type='cpu', dtype='float32', session_len=256, block_size=4, num_gpu_blocks=128)
    engine = Engine(path, PytorchEngineConfig(**dict(cfg, **kw)))
    try:
        return generate_all(engine, prompts, greedy(NEW_TOKENS))
    finally:
        engine.close()


@pytest.mark.parametrize('name,cls', [('mistral', MistralForCausalLM), ('qwen2', Qwen2ForCausalLM),
                                      ('qwen3', Qwen3ForCausalLM), ('phi3', Phi3ForCausalLM)])
def test_decodes_as_transformers(name, cls, models, tmp_path):
    path = models(name)
    cfg = load_model_config(path)
    assert get_model_class(cfg) is cls
    want_windows = [WINDOW, WINDOW] if name in ('mistral', 'phi3') else [None, WINDOW]
    assert [layer_window(cfg, i, cls.attention_cls.window_rule) for i in range(2)] == want_windows
    prompts = _prompts()
    want = hf_greedy(path, prompts, NEW_TOKENS)
    assert _engine_tokens(path, prompts) == want
    # chunked prefill: 5-token chunks, each crossing the window's edge in the longer prompts
    assert _engine_tokens(path, prompts, max_prefill_token_num=5) == want
    # the window matters: the same weights attending fully give other logits past the window's edge (logits,
    # not tokens: a random model may repeat one token whatever it attends to)
    full = _without_window(path, str(tmp_path / 'full'))
    longest = prompts[-1]
    windowed, unwindowed = hf_logits(path, longest), hf_logits(full, longest)
    assert torch.allclose(windowed[:WINDOW], unwindowed[:WINDOW], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(windowed[WINDOW:], unwindowed[WINDOW:], rtol=1e-3, atol=1e-3)


def test_qwen2_without_layer_types_reads_max_window_layers(models, tmp_path):
    """A config.json written before transformers saved ``layer_types``: the window from layer
    ``max_window_layers`` on, as transformers derives it."""
    path = models('qwen2')
    old = str(tmp_path / 'old')
    shutil.copytree(path, old)
    with open(os.path.join(old, 'config.json')) as f:
        cfg = json.load(f)
    assert cfg.pop('layer_types') == ['full_attention', 'sliding_attention']
    with open(os.path.join(old, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    mc = load_model_config(old)
    assert [layer_window(mc, i, 'layer_types') for i in range(2)] == [None, WINDOW]
    prompts = _prompts()[1:]
    assert _engine_tokens(old, prompts) == hf_greedy(path, prompts, NEW_TOKENS)


def test_use_sliding_window_false_means_full_attention(models, tmp_path):
    path = models('qwen2')
    off = str(tmp_path / 'off')
    shutil.copytree(path, off)
    with open(os.path.join(off, 'config.json')) as f:
        cfg = json.load(f)
    cfg['use_sliding_window'] = False
    del cfg['layer_types']  # (transformers' cache refuses sliding layer types without a window)
    with open(os.path.join(off, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    mc = load_model_config(off)
    assert [layer_window(mc, i, 'layer_types') for i in range(2)] == [None, None]
    prompts = _prompts()[2:]
    assert _engine_tokens(off, prompts) == hf_greedy(off, prompts, NEW_TOKENS)


def test_a_cache_smaller_than_the_sequences_still_decodes_as_transformers(models):
    """Blocks behind the window are given back (scheduler._slide): 10 blocks of 4 tokens hold 40, three
    sequences of up to 65 tokens run through them (chunked by 5, preempting each other where they must) and
    decode as transformers, whose greedy tokens see the window only."""
    path = models('mistral')
    prompts = _prompts()
    want = hf_greedy(path, prompts, NEW_TOKENS)
    engine = Engine(path, PytorchEngineConfig(device_type='cpu', dtype='float32', session_len=256, block_size=4,
                                              num_gpu_blocks=10, max_prefill_token_num=5))
    try:
        assert engine.scheduler.kv_window == WINDOW
        assert generate_all(engine, prompts, greedy(NEW_TOKENS)) == want
        engine.scheduler.check_invariants()
    finally:
        engine.close()
