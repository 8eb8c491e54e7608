"""Baichuan2-7B (``BaichuanForCausalLM``) and Baichuan-7B (``BaiChuanForCausalLM``) on cpu/float32 decode token for
token as transformers does.

Their modeling code is remote code (baichuan-inc's modeling_baichuan.py, no transformers class), so each
checkpoint is built from a tiny transformers Llama of the equivalent layout and compared with that model. The
layout, from Baichuan2-7B's modeling_baichuan.py: Llama's names (``model.embed_tokens``, ``model.layers.N.
{input_layernorm, self_attn.o_proj, post_attention_layernorm, mlp.gate_proj / up_proj / down_proj}``,
``model.norm``, ``lm_head``) with q, k and v packed in ``self_attn.W_pack`` (``nn.Linear(hidden, 3 * hidden)``,
its output unflattened to (3, hidden): q rows, then k, then v), multi-head attention (no num_key_value_heads),
Llama's rotate_half RoPE with base 10000, no biases; Baichuan2's ``NormHead`` divides each row of the head's
weight by its L2 norm (``F.normalize(self.weight)``) before the product, Baichuan-7B's head is a plain Linear.
So: a tiny multi-head Llama (its final norm scaled by 5 so the normalised head's logits stay apart) whose
lm_head rows are normalised is the reference; the Baichuan2 checkpoint stores q/k/v packed and each head row
multiplied by a random factor in [0.2, 5] (which NormHead removes); the Baichuan-7B checkpoint stores the
reference's rows as they are.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from engine_utils import engine_tokens
from helpers import _COMMON, build_tiny_custom, hf_greedy

from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.baichuan import BaichuanForCausalLM, BaiChuanForCausalLM

NEW_TOKENS = 16
PROMPT_LENGTHS = (6, 21, 44)


def _prompts(seed=17):
    rng = random.Random(seed)
    return [[rng.randrange(20, 49152) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope='module')
def reference(smollm2_path, tmp_path_factory):
    """A multi-head Llama with unit-norm head rows, and its greedy tokens for _prompts()."""
    from safetensors.torch import load_file, save_file
    path = build_tiny_custom(str(tmp_path_factory.mktemp('baichuan') / 'llama'), smollm2_path, 'LlamaConfig',
                             dict(_COMMON, num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=False),
                             seed=31)
    file = os.path.join(path, 'model.safetensors')
    state = load_file(file)
    state['lm_head.weight'] = torch.nn.functional.normalize(state['lm_head.weight'], dim=-1)
    state['model.norm.weight'] = state['model.norm.weight'] * 5
    save_file(state, file, metadata={'format': 'pt'})
    return path, hf_greedy(path, _prompts(), NEW_TOKENS)


def llama_to_baichuan(src: str, out: str, architecture: str = 'BaichuanForCausalLM') -> str:
    """A Baichuan checkpoint (W_pack; Baichuan2's config fields, no max_position_embeddings but model_max_length as
    Baichuan2-13B's config) of the multi-head Llama ``src``; Baichuan2's head rows stored rescaled."""
    from safetensors.torch import load_file, save_file
    with open(os.path.join(src, 'config.json')) as f:
        cfg = json.load(f)
    assert cfg['num_key_value_heads'] == cfg['num_attention_heads'] and not cfg.get('attention_bias')
    state = load_file(os.path.join(src, 'model.safetensors'))
    new = {}
    for name, t in state.items():
        if '.self_attn.k_proj.' in name or '.self_attn.v_proj.' in name:
            continue
        if '.self_attn.q_proj.' in name:
            prefix = name.split('.self_attn.q_proj.')[0]
            new[f'{prefix}.self_attn.W_pack.weight'] = torch.cat(
                [state[f'{prefix}.self_attn.{p}_proj.weight'] for p in 'qkv'])
            continue
        new[name] = t
    if architecture == 'BaichuanForCausalLM':
        gen = torch.Generator().manual_seed(5)
        new['lm_head.weight'] = new['lm_head.weight'] * torch.exp(torch.empty(cfg['vocab_size'], 1).uniform_(
            -1.6, 1.6, generator=gen))
    config = dict(architectures=[architecture], model_type='baichuan', hidden_size=cfg['hidden_size'],
                  intermediate_size=cfg['intermediate_size'], num_attention_heads=cfg['num_attention_heads'],
                  num_hidden_layers=cfg['num_hidden_layers'], vocab_size=cfg['vocab_size'], hidden_act='silu',
                  rms_norm_eps=cfg['rms_norm_eps'], model_max_length=cfg['max_position_embeddings'],
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, torch_dtype='float32',
                  auto_map={'AutoModelForCausalLM': 'modeling_baichuan.BaichuanForCausalLM'})
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        if name not in ('config.json', 'model.safetensors') and os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
    save_file({k: v.contiguous() for k, v in new.items()}, os.path.join(out, 'model.safetensors'))
    with open(os.path.join(out, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2)
    return out


def _engine_tokens(path, prompts, tp=1):
    return engine_tokens(path, prompts, NEW_TOKENS, device_type='cpu', dtype='float32', tp=tp, session_len=256,
                         block_size=16, num_gpu_blocks=48)


@pytest.mark.parametrize('arch,cls', [('BaichuanForCausalLM', BaichuanForCausalLM),
                                      ('BaiChuanForCausalLM', BaiChuanForCausalLM)])
def test_baichuan_decodes_as_the_llama_it_packs(arch, cls, reference, tmp_path):
    path, want = reference
    converted = llama_to_baichuan(path, str(tmp_path / 'baichuan'), arch)
    cfg = load_model_config(converted)
    assert get_model_class(cfg) is cls
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings, cfg.rope.theta) == (4, 16, 512, 10000.0)
    assert _engine_tokens(converted, _prompts()) == want


def test_baichuan2_head_rows_are_normalised(reference, tmp_path):
    """The stored head's rows are not unit rows (so the test above needs NormHead): read as they are, the greedy
    tokens part from the reference's."""
    path, want = reference
    converted = llama_to_baichuan(path, str(tmp_path / 'baichuan'))
    with open(os.path.join(converted, 'config.json')) as f:
        raw = json.load(f)
    raw['architectures'] = ['BaiChuanForCausalLM']  # a plain head over the rescaled rows
    with open(os.path.join(converted, 'config.json'), 'w') as f:
        json.dump(raw, f)
    assert _engine_tokens(converted, _prompts()) != want


def test_baichuan2_tp2_equals_transformers(reference, tmp_path):
    """Two ranks on gloo, each reading only its heads' rows of W_pack and its vocabulary rows of the head (each
    normalised on its own)."""
    path, want = reference
    converted = llama_to_baichuan(path, str(tmp_path / 'baichuan'))
    assert _engine_tokens(converted, _prompts(), tp=2) == want


def test_baichuan2_builtin_chat_template():
    """``--chat-template baichuan2``: Baichuan2's build_chat_input (generation_utils.py) puts the system text first,
    user_token_id 195 (<reserved_106>) before each user turn and assistant_token_id 196 (<reserved_107>) before
    each reply, nothing after a reply; generation stops at EOS."""
    from lmdeploy.frontend.chat_template import ChatTemplateConfig, list_builtin_templates
    assert 'baichuan2' in list_builtin_templates()
    t = ChatTemplateConfig(model_name='baichuan2').to_template()
    messages = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'},
                {'role': 'assistant', 'content': 'Hello!'}, {'role': 'user', 'content': 'Bye'}]
    assert t.messages2prompt(messages) == 'Be brief.<reserved_106>Hi<reserved_107>Hello!<reserved_106>Bye<reserved_107>'
    assert t.stop_words == []
