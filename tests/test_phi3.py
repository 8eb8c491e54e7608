"""Phi-3 / Phi-3.5-mini / Phi-4 (``Phi3ForCausalLM``) on cpu/float32 decode token for token as transformers does.

Tiny random Phi3 models built with transformers' own Phi3 (fused ``qkv_proj`` and ``gate_up_proj``):

* plain rope;
* LongRoPE (original_max_position_embeddings 32, max 128, short/long factors random in [1, 4]): prompts
  that stay within 32 with their generation, and prompts longer than 32 from the start. transformers picks
  the factors per forward by max(position_ids) + 1 (modeling_rope_utils' longrope_frequency_update): the
  prompt's length for the prefill, position + 1 for each decoded token; the engine does the same per token
  from ``rope_lens``.
* A sequence that passes 32 while decoding: transformers' Phi3ForCausalLM.prepare_inputs_for_generation
  drops the KV cache at that step (the input reaches original + 1 tokens with at most original cached) and
  recomputes the whole sequence with the long factors, every layer's keys and values included. The engine
  keeps the cache (its keys rotated with the short factors, later layers computed from them) and rotates
  only new tokens with the long ones, so greedy tokens part from transformers' after the crossing: a strict
  xfail until the scheduler recomputes a sequence as it crosses (preemption by recompute would do it).
"""
from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch
from engine_utils import generate_all, greedy
from helpers import build_tiny_custom, hf_greedy_fresh, tiny_phi3_kwargs

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.phi3 import Phi3ForCausalLM, split_rows
from lmdeploy.engine.nn.loading import CheckpointTensor
from lmdeploy.messages import PytorchEngineConfig

NEW_TOKENS = 16
ORIGINAL = 32
# 5 + 16 and 12 + 16 stay within 32; 40 is past it from the prefill on
PROMPT_LENGTHS = (5, 12, 40)
CROSSING = 20  # 20 + 16 passes 32 while decoding


def _prompts(seed=11, lengths=PROMPT_LENGTHS):
    rng = random.Random(seed)
    return [[rng.randrange(20, 49152) for _ in range(n)] for n in lengths]


@pytest.fixture(scope='module')
def phi3(smollm2_path, tmp_path_factory):
    """name -> (checkpoint, transformers' greedy tokens for _prompts())."""
    root = tmp_path_factory.mktemp('phi3')
    made = {}

    def get(name):
        if name not in made:
            kwargs = tiny_phi3_kwargs(longrope=name != 'plain', original=ORIGINAL, seed=5,
                                      partial=0.5 if name == 'partial_longrope' else 1.0)
            path = build_tiny_custom(str(root / name), smollm2_path, 'Phi3Config', kwargs, seed=2468)
            made[name] = path, hf_greedy_fresh(path, _prompts() + _prompts(lengths=(CROSSING, )), NEW_TOKENS)
        return made[name]

    return get


def _engine_tokens(path, prompts, tp=1):
    engine = Engine(path, PytorchEngineConfig(device_type='cpu', dtype='float32', tp=tp, session_len=256,
                                              block_size=16, num_gpu_blocks=48))
    try:
        return generate_all(engine, prompts, greedy(NEW_TOKENS))
    finally:
        engine.close()


@pytest.mark.parametrize('name', ['plain', 'longrope', 'partial_longrope'])
def test_phi3_decodes_as_transformers(name, phi3):
    """partial_longrope: rotary on half of each head (Phi-4-mini's partial_rotary_factor, 0.75 there)."""
    path, want = phi3(name)
    cfg = load_model_config(path)
    assert get_model_class(cfg) is Phi3ForCausalLM
    assert cfg.rope.type == ('default' if name == 'plain' else 'longrope')
    assert cfg.rope.partial_rotary_factor == (0.5 if name == 'partial_longrope' else 1.0)
    from helpers import _load_hf
    assert _load_hf(os.path.abspath(path)).model.rotary_emb.inv_freq.numel() == 8 * cfg.rope.partial_rotary_factor
    assert _engine_tokens(path, _prompts()) == want[:len(PROMPT_LENGTHS)]


def test_phi3_tp2_equals_transformers(phi3):
    """Two ranks on gloo, each reading only its heads' rows of qkv_proj (reordered for partial rotary) and its
    rows of gate_up_proj."""
    path, want = phi3('partial_longrope')
    assert _engine_tokens(path, _prompts(), tp=2) == want[:len(PROMPT_LENGTHS)]


@pytest.mark.xfail(strict=True, reason='transformers recomputes the whole sequence (cache dropped) when it first '
                   'passes original_max_position_embeddings; the engine keeps its short-factor cache')
def test_longrope_sequence_crossing_the_original_length(phi3):
    path, want = phi3('longrope')
    assert _engine_tokens(path, _prompts(lengths=(CROSSING, ))) == want[-1:]


def test_longrope_config_as_transformers_reads_it(phi3):
    """The factors, the original length and the attention factor transformers' rotary embedding holds."""
    path, _ = phi3('longrope')
    from helpers import _load_hf
    rotary = _load_hf(os.path.abspath(path)).model.rotary_emb
    rope = load_model_config(path).rope
    assert rope.original_max_position_embeddings == ORIGINAL
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(128 / ORIGINAL) / math.log(ORIGINAL)))
    assert rope.attention_factor == rotary.attention_scaling
    from lmdeploy.devices import get_device
    from lmdeploy.engine.nn.build import building
    from lmdeploy.engine.nn.rotary import RotaryEmbedding
    with building(get_device('cpu')):
        ours = RotaryEmbedding(16, rope, 128)
    assert torch.equal(ours.inv_freq, rotary.original_inv_freq)


def _legacy_config(tmp_path, **rope_scaling):
    cfg = dict(architectures=['Phi3ForCausalLM'], model_type='phi3', hidden_size=64, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=100,
               max_position_embeddings=128, original_max_position_embeddings=32, rope_theta=10000.0,
               rope_scaling=rope_scaling, sliding_window=None)
    (tmp_path / 'config.json').write_text(json.dumps(cfg))
    return str(tmp_path)


def test_legacy_su_rope_scaling_reads_as_longrope(tmp_path):
    """Phi-3-mini-128k's config.json: rope_scaling {type: su|longrope, short/long factors}, the original length
    at the top level, no factor (so max / original gives the attention factor)."""
    path = _legacy_config(tmp_path, type='su', short_factor=[1.0] * 8, long_factor=[2] * 8)
    rope = load_model_config(path).rope
    assert (rope.type, rope.original_max_position_embeddings) == ('longrope', 32)
    assert rope.long_factor == [2.0] * 8
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))


@pytest.mark.parametrize('fields,match', [
    (dict(type='longrope', short_factor=[1.0] * 8), "'rope_scaling.long_factor' is missing"),
    (dict(type='longrope', short_factor=[1.0] * 8, long_factor=[0] * 8), 'long_factor.*positive numbers'),
    (dict(type='longrope', short_factor=[1.0] * 8, long_factor=[1.0] * 8, partial_rotary_factor=1.5),
     "'rope_scaling.partial_rotary_factor' must be a number in"),
])
def test_bad_longrope_configs_are_refused(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        load_model_config(_legacy_config(tmp_path, **fields))


def test_split_rows_reads_only_the_rows_asked_for():
    fused = torch.arange(10 * 3).reshape(10, 3)
    reads = []

    class Counting(CheckpointTensor):

        def take(self, rows=None, cols=None):
            reads.append(rows)
            return super().take(rows, cols)

    parts = split_rows(Counting(fused), {'q': 4, 'k': 3, 'v': 3}, 'qkv_proj.weight')
    assert torch.equal(parts['k'].take(range(1, 3)), fused[5:7]) and reads == [range(5, 7)]
    assert torch.equal(parts['v'].take(), fused[7:])
    with pytest.raises(ValueError, match=r'qkv_proj.weight: 10 rows, expected q 4 \+ k 4 \+ v 4 = 12'):
        split_rows(CheckpointTensor(fused), {'q': 4, 'k': 4, 'v': 4}, 'qkv_proj.weight')


def test_partial_rotary_is_refused_where_q_and_k_are_not_laid_out_for_it(tmp_path):
    from lmdeploy.devices import get_device
    from lmdeploy.engine.nn.build import building
    from lmdeploy.engine.nn.rotary import RotaryEmbedding, partial_rotary_order
    path = _legacy_config(tmp_path, type='longrope', short_factor=[1.0] * 6, long_factor=[1.0] * 6,
                          partial_rotary_factor=0.75)
    rope = load_model_config(path).rope
    with building(get_device('cpu')):
        with pytest.raises(ValueError, match='partial_rotary_factor 0.75 .rotary on 12 of head_dim 16. is not '
                           'supported'):
            RotaryEmbedding(16, rope, 128)
        assert RotaryEmbedding(16, rope, 128, partial_layout=True).rotary_dim == 12
    assert partial_rotary_order(8, 4) == [0, 1, 4, 5, 2, 3, 6, 7]
