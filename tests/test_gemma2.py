"""Gemma 2 (Gemma2ForCausalLM) on cpu / float32 decodes token for token as transformers does.

A tiny random Gemma2 built with transformers' Gemma2Config: hidden 64, 3 layers (0 and 2 attend within a
6-token window, 1 fully: the config's default layer_types), 4 query heads of 32 over 2 KV heads,
query_pre_attn_scalar 24 (not head_dim), attention scores soft-capped at 3 and logits at 5 (both bite on
these weights), norm weights stored around 0 as Gemma's (1 + w) RMSNorm wants them. Prompts up to 41
tokens, whole and prefilled in chunks, decoding past the window.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from engine_utils import EngineCache, engine_tokens, greedy, submit
from helpers import GEMMA2_WINDOW as WINDOW
from helpers import build_tiny_gemma2, edited_copy, hf_greedy, hf_logits, lively_model, random_prompts

from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.gemma2 import Gemma2ForCausalLM

NEW_TOKENS = 20
CONFIG = dict(device_type='cpu', dtype='float32', session_len=256, block_size=4, num_gpu_blocks=128)


@pytest.fixture(scope='module')
def gemma2(smollm2_path, tmp_path_factory):
    root = tmp_path_factory.mktemp('gemma2')
    return lively_model(lambda seed: build_tiny_gemma2(str(root / f'm-{seed}'), smollm2_path, seed),
                        new_tokens=NEW_TOKENS)


@pytest.fixture(scope='module')
def engines():
    """The module's tp=1 engines, each started once."""
    cache = EngineCache()
    yield cache
    cache.close()


def test_gemma2_decodes_as_transformers(gemma2, engines, tmp_path):
    path, seed = gemma2
    cfg = load_model_config(path)
    model_cls = get_model_class(cfg)
    assert model_cls is Gemma2ForCausalLM
    with open(os.path.join(path, 'config.json')) as f:
        saved = json.load(f)
    assert saved['layer_types'] == ['sliding_attention', 'full_attention', 'sliding_attention']
    prompts = random_prompts(seed)
    want = hf_greedy(path, prompts, NEW_TOKENS)
    assert engines.tokens(path, prompts, NEW_TOKENS, **CONFIG) == want
    # chunks crossing the window's edge
    assert engines.tokens(path, prompts, NEW_TOKENS, **CONFIG, max_prefill_token_num=5) == want
    assert len({t for seq in want for t in seq}) > 8  # not a degenerate repeat
    # each feature bites: the same weights without the window, or without the score cap, decode otherwise
    for i, change in enumerate(({'sliding_window': 4096}, {'attn_logit_softcapping': None})):
        other = edited_copy(path, str(tmp_path / f'other{i}'), **change)
        assert hf_greedy(other, prompts, NEW_TOKENS) != want, change


def test_gemma2_logits_are_soft_capped_as_transformers(gemma2, engines):
    """Every position's logits (the final cap included: greedy tokens alone would not see it)."""
    path, seed = gemma2
    ids = random_prompts(seed)[2]
    out = submit(engines.get(path, **CONFIG), ids, greedy(3, output_logits='all')).wait()
    got = torch.cat([o.logits for o in out.outputs if o.logits is not None])
    want = hf_logits(path, ids + out.token_ids[:-1])
    assert got.abs().max() < 5.0 and (want.abs() > 4.0).any()  # within the cap, and the cap bites
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_gemma2_without_layer_types_alternates(gemma2, tmp_path):
    """An older config.json (no layer_types): even layers slide, as transformers' Gemma2Config derives."""
    path, seed = gemma2
    old = edited_copy(path, str(tmp_path / 'old'), lambda c: c.pop('layer_types'))
    from lmdeploy.engine.model_config import layer_window
    assert [layer_window(load_model_config(old), i, 'alternate') for i in range(3)] == [WINDOW, None, WINDOW]
    prompts = random_prompts(seed)[2:]
    assert engine_tokens(old, prompts, NEW_TOKENS, **CONFIG) == hf_greedy(path, prompts, NEW_TOKENS)


def test_gemma2_tp2_decodes_as_transformers(gemma2):
    """Two ranks on gloo: 2 query heads and 1 KV head each (each with its layer's window, scale and cap), half
    the MLP; the soft cap on the gathered logits."""
    path, seed = gemma2
    prompts = random_prompts(seed)[1:]
    assert engine_tokens(path, prompts, NEW_TOKENS, **CONFIG, tp=2) == hf_greedy(path, prompts, NEW_TOKENS)
