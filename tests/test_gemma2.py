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
import random
import shutil

import pytest
import torch
from engine_utils import generate_all, greedy, submit
from helpers import _copy_tokenizer, _make_config, _randomize, hf_greedy, hf_logits

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.gemma2 import Gemma2ForCausalLM
from lmdeploy.messages import PytorchEngineConfig

NEW_TOKENS = 20
WINDOW = 6


def build_tiny_gemma2(out: str, tokenizer_dir: str, seed: int, **overrides) -> str:
    from transformers import AutoModelForCausalLM
    kwargs = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2, rope_theta=10000.0,
                  tie_word_embeddings=True, hidden_activation='gelu_pytorch_tanh', query_pre_attn_scalar=24,
                  sliding_window=WINDOW, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    cfg = _make_config('Gemma2Config', dict(kwargs, **overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    scale = cfg.hidden_size**0.5
    with torch.no_grad():
        # as build_tiny_gemma: the embedding stored sqrt(hidden) smaller (it enters scaled), the final norm
        # that much larger; every norm weight stored as its multiplier less 1
        model.model.embed_tokens.weight.div_(scale)
        model.model.norm.weight.mul_(scale)
        for name, p in model.named_parameters():
            if 'norm' in name:
                p.sub_(1.0)
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    _copy_tokenizer(tokenizer_dir, out)
    return out


def _prompts(seed):
    rng = random.Random(seed)
    return [[rng.randrange(20, 49152) for _ in range(n)] for n in (3, 17, 41)]


@pytest.fixture(scope='module')
def gemma2(smollm2_path, tmp_path_factory):
    seed = int.from_bytes(os.urandom(2), 'little')
    return build_tiny_gemma2(str(tmp_path_factory.mktemp('gemma2') / 'm'), smollm2_path, seed), seed


def _engine(path, **kw):
    cfg = dict(device_type='cpu', dtype='float32', session_len=256, block_size=4, num_gpu_blocks=128)
    return Engine(path, PytorchEngineConfig(**dict(cfg, **kw)))


def _tokens(path, prompts, **kw):
    engine = _engine(path, **kw)
    try:
        return generate_all(engine, prompts, greedy(NEW_TOKENS))
    finally:
        engine.close()


def test_gemma2_decodes_as_transformers(gemma2, tmp_path):
    path, seed = gemma2
    cfg = load_model_config(path)
    model_cls = get_model_class(cfg)
    assert model_cls is Gemma2ForCausalLM
    with open(os.path.join(path, 'config.json')) as f:
        saved = json.load(f)
    assert saved['layer_types'] == ['sliding_attention', 'full_attention', 'sliding_attention']
    prompts = _prompts(seed)
    want = hf_greedy(path, prompts, NEW_TOKENS)
    assert _tokens(path, prompts) == want
    assert _tokens(path, prompts, max_prefill_token_num=5) == want  # chunks crossing the window's edge
    assert len({t for seq in want for t in seq}) > 8  # not a degenerate repeat
    # each feature bites: the same weights without the window, or without the score cap, decode otherwise
    for i, change in enumerate(({'sliding_window': 4096}, {'attn_logit_softcapping': None})):
        other = str(tmp_path / f'other{i}')
        shutil.copytree(path, other)
        with open(os.path.join(other, 'config.json'), 'w') as f:
            json.dump(dict(saved, **change), f)
        assert hf_greedy(other, prompts, NEW_TOKENS) != want, change


def test_gemma2_logits_are_soft_capped_as_transformers(gemma2):
    """Every position's logits (the final cap included: greedy tokens alone would not see it)."""
    path, seed = gemma2
    ids = _prompts(seed)[2]
    engine = _engine(path)
    try:
        out = submit(engine, ids, greedy(3, output_logits='all')).wait()
    finally:
        engine.close()
    got = torch.cat([o.logits for o in out.outputs if o.logits is not None])
    want = hf_logits(path, ids + out.token_ids[:-1])
    assert got.abs().max() < 5.0 and (want.abs() > 4.0).any()  # within the cap, and the cap bites
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_gemma2_without_layer_types_alternates(gemma2, tmp_path):
    """An older config.json (no layer_types): even layers slide, as transformers' Gemma2Config derives."""
    path, seed = gemma2
    old = str(tmp_path / 'old')
    shutil.copytree(path, old)
    with open(os.path.join(old, 'config.json')) as f:
        cfg = json.load(f)
    del cfg['layer_types']
    with open(os.path.join(old, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    from lmdeploy.engine.model_config import layer_window
    assert [layer_window(load_model_config(old), i, 'alternate') for i in range(3)] == [WINDOW, None, WINDOW]
    prompts = _prompts(seed)[2:]
    assert _tokens(old, prompts) == hf_greedy(path, prompts, NEW_TOKENS)


def test_gemma2_tp2_decodes_as_transformers(gemma2):
    """Two ranks on gloo: 2 query heads and 1 KV head each (each with its layer's window, scale and cap), half
    the MLP; the soft cap on the gathered logits."""
    path, seed = gemma2
    prompts = _prompts(seed)[1:]
    assert _tokens(path, prompts, tp=2) == hf_greedy(path, prompts, NEW_TOKENS)
