"""Falcon (``FalconForCausalLM``) on cpu / float32 decodes token for token as transformers does, in each of
the three packings of ``query_key_value`` (transformers' FalconAttention._split_heads):

* ``multi_query``: the old architecture with one KV head (falcon-7b): parallel attention and MLP on one
  LayerNorm, no biases;
* ``grouped``: ``new_decoder_architecture`` with 2 KV heads for 4 query heads (falcon-40b / 180b): ln_attn and
  ln_mlp, biases (``bias``);
* ``grouped_one_norm``: the same with ``num_ln_in_parallel_attn`` 1 (falcon2-11b), no biases;
* ``multi_head``: the old architecture without multi_query (every head its own k and v, packed per head) and
  without parallel_attn (attention, then the MLP on post_attention_layernorm), biases, an untied head.

Tiny random models from transformers' FalconConfig (hidden 64, 2 layers, heads of 16, ffn 128, erf GELU),
randomized as the tests' tied Llama (LayerNorm weights ~1, biases ~0, the final norm x5 over a small tied
embedding). ALiBi (falcon-rw): tests/test_alibi_models.py.
"""
from __future__ import annotations

import json

import pytest
from engine_utils import engine_tokens
from helpers import build_tiny_falcon, hf_greedy, lively_model, random_prompts

from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.falcon import FalconForCausalLM

NEW_TOKENS = 16
CONFIG = dict(device_type='cpu', dtype='float32', session_len=256, block_size=4, num_gpu_blocks=128)
BASE = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=128,
            max_position_embeddings=512, layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
            rope_theta=10000.0, alibi=False)
SPECS = {  # name -> (config, KV heads it makes)
    'multi_query': (dict(BASE, new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False), 1),
    'grouped': (dict(BASE, new_decoder_architecture=True, num_kv_heads=2, bias=True), 2),
    'grouped_one_norm': (dict(BASE, new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1,
                              bias=False), 2),
    'multi_head': (dict(BASE, new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True,
                        tie_word_embeddings=False), 4),
}


@pytest.fixture(scope='module')
def models(smollm2_path, tmp_path_factory):
    root = tmp_path_factory.mktemp('falcon')
    made = {}

    def get(name):
        if name not in made:
            made[name] = lively_model(lambda seed: build_tiny_falcon(str(root / f'{name}-{seed}'), smollm2_path,
                                                                     SPECS[name][0], seed), new_tokens=NEW_TOKENS)
        return made[name]

    return get


def _tokens(path, prompts, **kw):
    return engine_tokens(path, prompts, NEW_TOKENS, **dict(CONFIG, **kw))


@pytest.mark.parametrize('name', list(SPECS))
def test_falcon_decodes_as_transformers(name, models):
    path, seed = models(name)
    cfg = load_model_config(path)
    assert get_model_class(cfg) is FalconForCausalLM
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (4, SPECS[name][1], 16, 128)
    prompts = random_prompts(seed)
    want = hf_greedy(path, prompts, NEW_TOKENS)
    assert len({t for seq in want for t in seq}) > 8  # not a degenerate repeat
    assert _tokens(path, prompts) == want


def test_falcon_tp2_equals_transformers(models):
    """Two ranks on gloo, multi_query: the one KV head on both, the query heads split (the grouped layout's
    per-group rows are InternLM2's wqkv, read per rank as test_internlm checks on two ranks)."""
    path, seed = models('multi_query')
    prompts = random_prompts(seed)
    assert _tokens(path, prompts, tp=2) == hf_greedy(path, prompts, NEW_TOKENS)


def test_falcon_on_the_emulated_ascend_device(models, emulated_npu):
    """The ascend device's layer_norm and npu_gelu (erf) in the grouped layout, on the torch_npu emulation:
    transformers' tokens (computed before the emulation is switched on)."""
    path, seed = models('grouped')
    prompts = random_prompts(seed)
    want = hf_greedy(path, prompts, NEW_TOKENS)
    emulated_npu.activate()
    try:
        import torch_npu
        calls, gelu = [], torch_npu.npu_gelu
        torch_npu.npu_gelu = lambda x, approximate='none': (calls.append(approximate), gelu(x, approximate))[1]
        assert _tokens(path, prompts, device_type='ascend', eager_mode=True) == want
        assert calls and set(calls) == {'none'}  # the device's own GELU ran, in the model's form
    finally:
        emulated_npu.deactivate()


@pytest.mark.parametrize('changes,match', [
    (dict(apply_residual_connection_post_layernorm=True), 'apply_residual_connection_post_layernorm'),
    (dict(multi_query=False, num_kv_heads=2), "'num_kv_heads' must equal num_attention_heads"),
])
def test_unsupported_falcon_configs_are_refused(tmp_path, changes, match):
    cfg = dict(BASE, architectures=['FalconForCausalLM'], model_type='falcon', new_decoder_architecture=False,
               multi_query=True)
    (tmp_path / 'config.json').write_text(json.dumps(dict(cfg, **changes)))
    with pytest.raises(ValueError, match=match):
        load_model_config(str(tmp_path))


def test_legacy_falcon_field_names(tmp_path):
    """falcon-40b's first config.json: n_embed, n_head, n_head_kv, n_layer; no ffn_hidden_size (4 x hidden)."""
    cfg = dict(architectures=['FalconForCausalLM'], model_type='falcon', n_embed=64, n_head=4, n_head_kv=2,
               n_layer=2, new_decoder_architecture=True, vocab_size=100)
    (tmp_path / 'config.json').write_text(json.dumps(cfg))
    got = load_model_config(str(tmp_path))
    assert (got.hidden_size, got.num_heads, got.num_kv_heads, got.num_layers, got.intermediate_size) == (64, 4, 2, 2,
                                                                                                        256)
    assert got.tie_word_embeddings and got.rms_norm_eps == 1e-5 and got.max_position_embeddings == 2048
