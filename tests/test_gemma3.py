"""Gemma 3 text (Gemma3ForCausalLM) on cpu / float32 decodes token for token as transformers does.

A tiny random Gemma3 built with transformers' Gemma3TextConfig: hidden 64, 4 layers with
sliding_window_pattern 3 (layers 0, 1 and 3 attend within a 6-token window, layer 2 fully), 4 query heads of
32 over 2 KV heads, query_pre_attn_scalar 24, q/k norms, local rotary base 100 and global base 10,000 with
linear scaling x4 (all three differ, so a layer given the wrong rotary would decode otherwise), no soft caps
(Gemma 3's null). Norm weights stored around 0, as Gemma's (1 + w) RMSNorm wants them. Prompts up to 41
tokens, whole and prefilled in chunks, decoding past the window.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from engine_utils import generate_all, greedy
from helpers import _copy_tokenizer, _randomize, hf_greedy

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.gemma3 import Gemma3Attention, Gemma3ForCausalLM, gemma3_layer_types
from lmdeploy.messages import PytorchEngineConfig

NEW_TOKENS = 20
WINDOW = 6
TYPES = ['sliding_attention', 'sliding_attention', 'full_attention', 'sliding_attention']


def build_tiny_gemma3(out: str, tokenizer_dir: str, seed: int) -> str:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                           rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                           tie_word_embeddings=True, hidden_activation='gelu_pytorch_tanh', query_pre_attn_scalar=24,
                           sliding_window=WINDOW, sliding_window_pattern=3, rope_theta=10000.0,
                           rope_local_base_freq=100.0, rope_scaling={'rope_type': 'linear', 'factor': 4.0})
    assert cfg.layer_types == TYPES and cfg.attn_logit_softcapping is None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    assert type(model).__name__ == 'Gemma3ForCausalLM'
    _randomize(model, seed)
    scale = cfg.hidden_size**0.5
    with torch.no_grad():
        # as build_tiny_gemma2: the embedding stored sqrt(hidden) smaller (it enters scaled), the final norm that
        # much larger, every norm weight (q/k norms included) stored as its multiplier less 1
        model.model.embed_tokens.weight.div_(scale)
        model.model.norm.weight.mul_(scale)
        for name, p in model.named_parameters():
            if 'norm' in name:
                p.sub_(1.0)
    for key in ('bos_token_id', 'eos_token_id', 'pad_token_id'):
        setattr(model.generation_config, key, getattr(cfg, key))
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    _copy_tokenizer(tokenizer_dir, out)
    return out


def _prompts(seed):
    rng = random.Random(seed)
    return [[rng.randrange(20, 49152) for _ in range(n)] for n in (3, 17, 41)]


@pytest.fixture(scope='module')
def gemma3(smollm2_path, tmp_path_factory):
    seed = int.from_bytes(os.urandom(2), 'little')
    return build_tiny_gemma3(str(tmp_path_factory.mktemp('gemma3') / 'm'), smollm2_path, seed), seed


def _tokens(path, prompts, **kw):
    cfg = dict(device_type='cpu', dtype='float32', session_len=256, block_size=4, num_gpu_blocks=128)
    engine = Engine(path, PytorchEngineConfig(**dict(cfg, **kw)))
    try:
        return generate_all(engine, prompts, greedy(NEW_TOKENS))
    finally:
        engine.close()


def _variant(path, dest, edit) -> str:
    shutil.copytree(path, dest)
    with open(os.path.join(dest, 'config.json')) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(os.path.join(dest, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    return dest


def test_gemma3_decodes_as_transformers(gemma3, tmp_path, monkeypatch):
    path, seed = gemma3
    cfg = load_model_config(path)
    assert cfg.model_type == 'gemma3_text' and get_model_class(cfg) is Gemma3ForCausalLM
    assert gemma3_layer_types(cfg) == TYPES
    prompts = _prompts(seed)
    want = hf_greedy(path, prompts, NEW_TOKENS)
    assert _tokens(path, prompts) == want
    assert _tokens(path, prompts, max_prefill_token_num=5) == want  # chunks crossing the window's edge
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
        other = _variant(path, str(tmp_path / edit.__name__), edit)
        assert hf_greedy(other, prompts[2:], NEW_TOKENS) != want[2:], edit.__name__
    # ... and so does this engine without its q/k norms
    monkeypatch.setattr(Gemma3Attention, 'qk_norm', lambda self, q, k: (q, k))
    assert _tokens(path, prompts[2:]) != want[2:]


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

    old = _variant(path, str(tmp_path / 'hub'), hub_style)
    assert gemma3_layer_types(load_model_config(old)) == TYPES
    prompts = _prompts(seed)[2:]
    want = hf_greedy(path, prompts, NEW_TOKENS)
    assert hf_greedy(old, prompts, NEW_TOKENS) == want  # transformers reads both forms alike
    assert _tokens(old, prompts) == want


def test_gemma3_tp2_decodes_as_transformers(gemma3):
    """Two ranks on gloo: 2 query heads and 1 KV head each, with their q/k norms and their layer's rotary."""
    path, seed = gemma3
    prompts = _prompts(seed)[1:]
    assert _tokens(path, prompts, tp=2) == hf_greedy(path, prompts, NEW_TOKENS)


def test_gemma3_multimodal_is_refused_by_name(gemma3, tmp_path):
    path, _ = gemma3

    def vlm(c):
        text = {k: v for k, v in c.items() if k not in ('architectures', 'model_type')}
        c.clear()
        c.update(architectures=['Gemma3ForConditionalGeneration'], model_type='gemma3', text_config=text)

    other = _variant(path, str(tmp_path / 'vlm'), vlm)
    with pytest.raises(ValueError, match='vision-language.*Gemma3ForCausalLM'):
        get_model_class(load_model_config(other))
