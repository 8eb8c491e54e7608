"""Gemma 3 text (Gemma3ForCausalLM) on cpu / float32 decodes token for token as transformers does.

A tiny random Gemma3 built with transformers' Gemma3TextConfig: hidden 64, 4 layers with
sliding_window_pattern 3 (layers 0, 1 and 3 attend within a 6-token window, layer 2 fully), 4 query heads of
32 over 2 KV heads, query_pre_attn_scalar 24, q/k norms, local rotary base 100 and global base 10,000 with
linear scaling x4 (all three differ, so a layer given the wrong rotary would decode otherwise), no soft caps
(Gemma 3's null). Norm weights stored around 0, as Gemma's (1 + w) RMSNorm wants them. Prompts up to 41
tokens, whole and prefilled in chunks, decoding past the window.
"""
from __future__ import annotations

import pytest
from engine_utils import EngineCache, engine_tokens
from helpers import GEMMA3_LAYER_TYPES as TYPES
from helpers import build_tiny_gemma3, edited_copy, hf_greedy, lively_model, random_prompts

from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.gemma3 import Gemma3Attention, Gemma3ForCausalLM, gemma3_layer_types

NEW_TOKENS = 20
CONFIG = dict(device_type='cpu', dtype='float32', session_len=256, block_size=4, num_gpu_blocks=128)


@pytest.fixture(scope='module')
def gemma3(smollm2_path, tmp_path_factory):
    root = tmp_path_factory.mktemp('gemma3')
    return lively_model(lambda seed: build_tiny_gemma3(str(root / f'm-{seed}'), smollm2_path, seed),
                        new_tokens=NEW_TOKENS)


@pytest.fixture(scope='module')
def engines():
    """The module's engines, each started once."""
    cache = EngineCache()
    yield cache
    cache.close()


def test_gemma3_decodes_as_transformers(gemma3, engines, tmp_path, monkeypatch):
    path, seed = gemma3
    cfg = load_model_config(path)
    assert cfg.model_type == 'gemma3_text' and get_model_class(cfg) is Gemma3ForCausalLM
    assert gemma3_layer_types(cfg) == TYPES
    prompts = random_prompts(seed)
    want = hf_greedy(path, prompts, NEW_TOKENS)
    assert engines.tokens(path, prompts, NEW_TOKENS, **CONFIG) == want
    # chunks crossing the window's edge
    assert engines.tokens(path, prompts, NEW_TOKENS, **CONFIG, max_prefill_token_num=5) == want
    assert len({t for seq in want for t in seq}) > 8  # not a degenerate repeat

    # each feature bites: transformers with one rope base for all layers, without the global layers' linear
    # scaling, or without the window decodes otherwise on the same weights ...
    def one_base(c):
        c['rope_parameters']['sliding_attention']['rope_theta'] = 10000.0

    def no_scaling(c):
        c['rope_parameters']['full_attention'] = {'rope_type': 'default', 'rope_theta': 10000.0}

    def no_window(c):
        c['sliding_window'] = 4096

    for edit in (one_base, no_scaling, no_window):  # (the longest prompt: 41 tokens, beyond the window)
        other = edited_copy(path, str(tmp_path / edit.__name__), edit)
        assert hf_greedy(other, prompts[2:], NEW_TOKENS) != want[2:], edit.__name__
    # ... and so does this engine without its q/k norms (the method is looked up at each step: the engine
    # started above runs without them from here on, until the patch is undone at the test's end)
    monkeypatch.setattr(Gemma3Attention, 'qk_norm', lambda self, q, k: (q, k))
    assert engines.tokens(path, prompts[2:], NEW_TOKENS, **CONFIG) != want[2:]


def test_gemma3_hub_style_config(gemma3, tmp_path):
    """A config.json as the hub's gemma-3-1b has it (written before transformers 5): rope_theta, rope_scaling
    and rope_local_base_freq at the top level and sliding_window_pattern instead of layer_types."""
    path, seed = gemma3

    def hub_style(c):
        ropes = c.pop('rope_parameters')
        del c['layer_types']
        c.pop('_sliding_window_pattern', None)
        full = dict(ropes['full_attention'])
        c.update(rope_theta=full.pop('rope_theta'), rope_scaling=full,
                 rope_local_base_freq=ropes['sliding_attention']['rope_theta'], sliding_window_pattern=3)

    old = edited_copy(path, str(tmp_path / 'hub'), hub_style)
    assert gemma3_layer_types(load_model_config(old)) == TYPES
    prompts = random_prompts(seed)[2:]
    want = hf_greedy(path, prompts, NEW_TOKENS)
    assert hf_greedy(old, prompts, NEW_TOKENS) == want  # transformers reads both forms alike
    assert engine_tokens(old, prompts, NEW_TOKENS, **CONFIG) == want


# Gemma 3 at tp=2 is not run here: its layer is Gemma 2's (test_gemma2's tp=2 test: per-layer windows, scale
# and caps on two ranks) plus q/k norms over head_dim, replicated on every rank as Qwen3's are
# (test_tensor_parallel's qwen3 at tp=2); the rotary it picks per layer is computed alike on every rank.


def test_gemma3_multimodal_is_refused_by_name(gemma3, tmp_path):
    path, _ = gemma3

    def vlm(c):
        text = {k: v for k, v in c.items() if k not in ('architectures', 'model_type')}
        c.clear()
        c.update(architectures=['Gemma3ForConditionalGeneration'], model_type='gemma3', text_config=text)

    other = edited_copy(path, str(tmp_path / 'vlm'), vlm)
    with pytest.raises(ValueError, match='vision-language.*Gemma3ForCausalLM'):
        get_model_class(load_model_config(other))
