"""InternLM2 / InternLM2.5 and InternLM3 on cpu/float32 decode token for token as transformers does.

Their reference modeling code is remote code (trust_remote_code), so each checkpoint here is built from a
transformers model of the equivalent layout and compared with that model:

* InternLM2 is Llama under other names with q, k and v packed in ``attention.wqkv``: for each KV head its
  ``num_attention_heads / num_key_value_heads`` query heads, then its k head, then its v head, head_dim rows
  each. That layout is the one InternLM's own converter to Llama undoes (InternLM/InternLM,
  tools/convert2llama.py: ``rearrange(wqkv, '(h gs d) dim -> h gs d dim', gs=2 + num_key_value_groups)``,
  then a split [groups, 1, 1] into q, k, v); lightllm's and LMDeploy's own InternLM2 loaders read it the
  same way. InternLM2's ``bias`` puts biases on wqkv and wo, which is Llama's ``attention_bias``; its MLP
  has none (modeling_internlm2.py). So a tiny random Llama (GQA: 4 query heads, 2 KV heads) is converted
  to InternLM2's names, packed wqkv and config fields (helpers.llama_to_internlm2) and its greedy tokens
  compared with transformers' on the Llama; also with attention biases (``bias: true``) and with dynamic
  NTK rope decoding past the trained length (as InternLM2.5-7B-Chat-1M's rope_scaling).
* InternLM3 keeps Llama's names; ``qkv_bias`` biases q, k, v and ``bias`` o_proj and the MLP
  (modeling_internlm3.py; LMDeploy's InternLM3 model reads the same flags). qkv_bias without bias is
  Qwen2's attention, so a tiny Qwen2 is the reference for that case, a Llama with dynamic rope (InternLM3's
  ``rope_type: dynamic``) for the plain one.
"""
from __future__ import annotations

import os
import random

import pytest
import torch
from engine_utils import generate_all, greedy
from helpers import _COMMON, build_tiny_custom, hf_greedy, llama_to_internlm2, pack_wqkv, to_internlm3

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.internlm2 import InternLM2ForCausalLM, unpack_wqkv
from lmdeploy.engine.models.internlm3 import InternLM3ForCausalLM
from lmdeploy.engine.nn.loading import CheckpointTensor
from lmdeploy.engine.nn.parallel import head_shard
from lmdeploy.messages import PytorchEngineConfig

NEW_TOKENS = 16
# the longest prompt + NEW_TOKENS passes llama_dynamic_rope's 64 trained positions
PROMPT_LENGTHS = (4, 19, 53)


def _prompts(seed=7):
    rng = random.Random(seed)
    return [[rng.randrange(20, 49152) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope='module')
def source_model(tiny_model_factory, smollm2_path, tmp_path_factory):
    """name -> a transformers checkpoint to convert from."""
    root = tmp_path_factory.mktemp('internlm_sources')
    extra = {'llama_attn_bias': ('LlamaConfig', dict(_COMMON, rope_theta=50000.0, tie_word_embeddings=False,
                                                     attention_bias=True))}
    built = {}

    def get(name):
        if name not in built:
            if name in extra:
                built[name] = build_tiny_custom(str(root / name), smollm2_path, *extra[name], seed=4321)
            else:
                built[name] = tiny_model_factory(name)
        return built[name]

    return get


@pytest.fixture(scope='module')
def converted(source_model, tmp_path_factory):
    """(family, source) -> (converted checkpoint, transformers' greedy tokens on the source for _prompts())."""
    root = tmp_path_factory.mktemp('internlm')
    made = {}

    def get(family, source):
        if (family, source) not in made:
            src = source_model(source)
            convert = llama_to_internlm2 if family == 'internlm2' else to_internlm3
            path = convert(src, str(root / f'{family}_{source}'))
            made[family, source] = path, hf_greedy(src, _prompts(), NEW_TOKENS)
        return made[family, source]

    return get


def _engine_tokens(path, prompts, tp=1):
    engine = Engine(path, PytorchEngineConfig(device_type='cpu', dtype='float32', tp=tp, session_len=256,
                                              block_size=16, num_gpu_blocks=48))
    try:
        return generate_all(engine, prompts, greedy(NEW_TOKENS))
    finally:
        engine.close()


@pytest.mark.parametrize('source', ['llama', 'llama_attn_bias', 'llama_dynamic_rope'])
def test_internlm2_decodes_as_the_llama_it_packs(source, converted):
    path, want = converted('internlm2', source)
    assert get_model_class(load_model_config(path)) is InternLM2ForCausalLM
    assert _engine_tokens(path, _prompts()) == want


@pytest.mark.parametrize('source', ['qwen2', 'llama_dynamic_rope'])
def test_internlm3_decodes_as_its_llama_layout(source, converted):
    path, want = converted('internlm3', source)
    assert get_model_class(load_model_config(path)) is InternLM3ForCausalLM
    assert _engine_tokens(path, _prompts()) == want


def test_internlm2_tp2_equals_transformers(converted):
    """Two ranks on gloo, each unpacking only its KV group's rows of wqkv (and of its bias)."""
    path, want = converted('internlm2', 'llama_attn_bias')
    assert _engine_tokens(path, _prompts(), tp=2) == want


class _CountingRows(CheckpointTensor):
    """Records the packed rows each read asks for."""

    def __init__(self, data):
        super().__init__(data)
        self.reads = []

    def take(self, rows=None, cols=None):
        self.reads.append(rows)
        return super().take(rows, cols)


@pytest.mark.parametrize('heads,kv,tp', [(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 2, 2), (6, 3, 2), (4, 4, 2)])
@pytest.mark.parametrize('bias', [False, True])
def test_unpacked_wqkv_gives_each_rank_its_rows_and_reads_no_others(heads, kv, tp, bias):
    d, hidden = 3, 5
    q, k, v = (torch.randn(n * d, *(() if bias else (hidden, ))) for n in (heads, kv, kv))
    packed = _CountingRows(pack_wqkv(q, k, v, kv))
    parts = unpack_wqkv(packed, heads, kv, d)
    assert [parts[p].shape for p in 'qkv'] == [tuple(t.shape) for t in (q, k, v)]
    assert all(torch.equal(parts[p].take(), t) for p, t in zip('qkv', (q, k, v)))
    group = heads // kv
    for rank in range(tp):
        qh, kvh = head_shard(heads, kv, rank, tp)
        for part, heads_of, whole in (('q', qh, q), ('k', kvh, k), ('v', kvh, v)):
            rows = range(heads_of.start * d, heads_of.stop * d)
            packed.reads.clear()
            assert torch.equal(parts[part].take(rows), whole[rows.start:rows.stop])
            # each read lies within one KV group's block of this part, and they add up to the rows asked for
            assert sum(len(r) for r in packed.reads) == len(rows)
            for r in packed.reads:
                assert r.start // ((group + 2) * d) == (r.stop - 1) // ((group + 2) * d)


def test_wqkv_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match='wqkv.*expected 2 KV groups'):
        unpack_wqkv(CheckpointTensor(torch.zeros(7, 4)), 4, 2, 3, 'model.layers.0.attention.wqkv.weight')


def test_config_fields_reach_the_model(converted):
    """InternLM2's ``bias`` and InternLM3's ``qkv_bias`` / ``bias`` pick the biased layers."""
    from lmdeploy.devices import get_device
    from lmdeploy.engine.nn.build import building
    path2 = converted('internlm2', 'llama_attn_bias')[0]
    cfg2, cfg3 = load_model_config(path2), load_model_config(converted('internlm3', 'qwen2')[0])
    assert cfg2.rope.theta == 50000.0 and os.path.isfile(os.path.join(path2, 'tokenizer.json'))
    with torch.device('meta'), building(get_device('cpu')):
        m2, m3 = InternLM2ForCausalLM(cfg2), InternLM3ForCausalLM(cfg3)
    a2, a3 = m2.model.layers[0].self_attn, m3.model.layers[0].self_attn
    assert a2.qkv_proj.bias is not None and a2.o_proj.bias is not None
    assert a3.qkv_proj.bias is not None and a3.o_proj.bias is None and m3.model.layers[0].mlp.down_proj.bias is None


def test_remote_config_module_reads_the_checkpoints_fields(converted, tmp_path):
    """benchmark/family_model.py gives an InternLM2 layout a configuration module of its own (for a peer engine
    that reads InternLM2's config through remote code): transformers loads it with every config.json field,
    and this engine still loads the checkpoint and decodes as before."""
    import json
    import shutil

    import transformers
    from helpers import benchmark_module
    path, want = converted('internlm2', 'llama')
    copy = str(tmp_path / 'with_remote_config')
    shutil.copytree(path, copy)
    benchmark_module('family_model').add_remote_config(copy)
    with open(os.path.join(copy, 'config.json')) as f:
        fields = json.load(f)
    assert fields['auto_map'] == {'AutoConfig': 'configuration_internlm2.InternLM2Config'}
    cfg = transformers.AutoConfig.from_pretrained(copy, trust_remote_code=True)
    assert type(cfg).__name__ == 'InternLM2Config' and cfg.model_type == 'internlm2'
    for key in ('hidden_size', 'num_attention_heads', 'num_key_value_heads', 'num_hidden_layers',
                'intermediate_size', 'vocab_size', 'bias', 'rms_norm_eps'):
        assert getattr(cfg, key) == fields[key], key
    assert _engine_tokens(copy, _prompts()) == want
