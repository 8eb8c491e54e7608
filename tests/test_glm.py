"""GLM-4 (``GlmForCausalLM``, ``Glm4ForCausalLM``) and the ChatGLM layout (``ChatGLMModel``) on cpu/float32 decode
token for token as transformers does.

* Glm and Glm4: tiny random models of transformers' own classes (GQA 4 query / 2 KV heads of 16, q/k/v biases,
  rotary on the interleaved pairs of half of each head, Glm4's post-norms), also Glm4 with rotary on whole heads.
* ChatGLM's modeling code is remote code (THUDM's modeling_chatglm.py, no transformers class), so each checkpoint
  is built from a tiny transformers Glm and compared with that model. The layout, from modeling_chatglm.py
  (ChatGLM2-6B's, ChatGLM3-6B's and glm-4-9b-chat's copies agree on it) and its configuration_chatglm.py:
  ``transformer.embedding.word_embeddings``, ``transformer.encoder.layers.N.{input_layernorm,
  self_attention.query_key_value, self_attention.dense, post_attention_layernorm, mlp.dense_h_to_4h,
  mlp.dense_4h_to_h}``, ``transformer.encoder.final_layernorm``, ``transformer.output_layer``; SelfAttention
  splits query_key_value's output into [heads, groups, groups] x kv_channels with ``multi_query_attention``
  (``multi_query_group_num`` KV heads), else views it as [heads, 3 * kv_channels] (each head's q, k, v); the MLP's
  swiglu chunks dense_h_to_4h into (gate, up); RotaryEmbedding(kv_channels // 2) with base 10000 * rope_ratio
  rotates the first half of each head on interleaved pairs (apply_rotary_pos_emb reshapes it to [..., R / 2, 2]);
  RMSNorm with ``layernorm_epsilon``; the vocabulary is ``padded_vocab_size``; biases on query_key_value only
  (``add_qkv_bias``). transformers' GLM conversion (models/glm/convert_glm_weights_to_hf.py) maps glm-4-9b-chat
  onto GlmForCausalLM by exactly these renames and the q/k/v split, which is what this file's ``glm_to_chatglm``
  inverts.
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
from lmdeploy.engine.models.glm import ChatGLMForCausalLM, Glm4ForCausalLM, GlmForCausalLM
from lmdeploy.engine.nn.rotary import interleaved_rotary_order

NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 17, 40)


def _prompts(seed=13):
    rng = random.Random(seed)
    return [[rng.randrange(20, 49152) for _ in range(n)] for n in PROMPT_LENGTHS]


def _glm_kwargs(kv_heads=2, partial=0.5, head_dim=16):
    return dict(_COMMON, num_key_value_heads=kv_heads, head_dim=head_dim, rope_theta=10000.0, tie_word_embeddings=False,
                attention_bias=True, partial_rotary_factor=partial, rope_scaling=dict(partial_rotary_factor=partial))


SOURCES = {
    'glm': ('GlmConfig', _glm_kwargs()),
    'glm_mha': ('GlmConfig', _glm_kwargs(kv_heads=4)),
    'glm_wide_heads': ('GlmConfig', _glm_kwargs(head_dim=32)),  # heads * head_dim (128) > hidden (64)
    'glm4': ('Glm4Config', _glm_kwargs()),
    'glm4_full_rotary': ('Glm4Config', _glm_kwargs(partial=1.0)),
}


@pytest.fixture(scope='module')
def source(smollm2_path, tmp_path_factory):
    """name -> (a transformers checkpoint, its greedy tokens for _prompts())."""
    root = tmp_path_factory.mktemp('glm')
    built = {}

    def get(name):
        if name not in built:
            cls_name, kwargs = SOURCES[name]
            path = build_tiny_custom(str(root / name), smollm2_path, cls_name, kwargs, seed=97)
            built[name] = path, hf_greedy(path, _prompts(), NEW_TOKENS)
        return built[name]

    return get


def glm_to_chatglm(src: str, out: str, rope_ratio: float = 1.0) -> str:
    """A ChatGLM checkpoint (modeling_chatglm.py's names, packed query_key_value, configuration_chatglm.py's
    fields) computing what the transformers Glm checkpoint ``src`` does; ``rope_ratio`` divides the stored
    rope_theta (ChatGLM's base is 10000 * rope_ratio)."""
    from safetensors.torch import load_file, save_file
    with open(os.path.join(src, 'config.json')) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(src, 'model.safetensors'))
    heads, kv_heads, d = cfg['num_attention_heads'], cfg['num_key_value_heads'], cfg['head_dim']
    params = cfg.get('rope_parameters') or {}
    assert params.get('partial_rotary_factor', cfg.get('partial_rotary_factor')) == 0.5
    assert params['rope_theta'] == 10000.0 * rope_ratio
    mqa = kv_heads != heads
    renames = [('model.embed_tokens.', 'transformer.embedding.word_embeddings.'),
               ('model.layers.', 'transformer.encoder.layers.'),
               ('model.norm.', 'transformer.encoder.final_layernorm.'),
               ('lm_head.', 'transformer.output_layer.'), ('.self_attn.o_proj.', '.self_attention.dense.'),
               ('.mlp.gate_up_proj.', '.mlp.dense_h_to_4h.'), ('.mlp.down_proj.', '.mlp.dense_4h_to_h.')]
    new = {}
    for name, t in state.items():
        if '.self_attn.k_proj.' in name or '.self_attn.v_proj.' in name:
            continue
        if '.self_attn.q_proj.' in name:
            prefix, param = name.split('.self_attn.q_proj.')
            q, k, v = (state[f'{prefix}.self_attn.{p}_proj.{param}'] for p in 'qkv')
            if mqa:
                packed = torch.cat([q, k, v])
            else:  # [heads, 3, d, ...]: each head's q, k, v
                per_head = [t.reshape(heads, d, *t.shape[1:]) for t in (q, k, v)]
                packed = torch.stack(per_head, 1).reshape(-1, *q.shape[1:])
            new[f'{prefix.replace("model.layers.", "transformer.encoder.layers.")}.self_attention.'
                f'query_key_value.{param}'] = packed
            continue
        for old, repl in renames:
            name = name.replace(old, repl)
        new[name] = t
    new['transformer.rotary_pos_emb.inv_freq'] = torch.ones(d // 4)  # stored by the release, unused
    config = dict(architectures=['ChatGLMModel'], model_type='chatglm', num_layers=cfg['num_hidden_layers'],
                  hidden_size=cfg['hidden_size'], ffn_hidden_size=cfg['intermediate_size'], kv_channels=d,
                  num_attention_heads=heads, multi_query_attention=mqa, padded_vocab_size=cfg['vocab_size'],
                  seq_length=cfg['max_position_embeddings'], layernorm_epsilon=cfg['rms_norm_eps'], rmsnorm=True,
                  apply_residual_connection_post_layernorm=False, post_layer_norm=True, add_bias_linear=False,
                  add_qkv_bias=True, original_rope=True, rope_ratio=rope_ratio, eos_token_id=cfg['eos_token_id'],
                  pad_token_id=cfg['pad_token_id'], torch_dtype='float32', tie_word_embeddings=False,
                  auto_map={'AutoModel': 'modeling_chatglm.ChatGLMForConditionalGeneration'})
    if mqa:
        config['multi_query_group_num'] = kv_heads
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


@pytest.mark.parametrize('name,cls', [('glm', GlmForCausalLM), ('glm4', Glm4ForCausalLM),
                                      ('glm4_full_rotary', Glm4ForCausalLM)])
def test_glm_decodes_as_transformers(name, cls, source):
    path, want = source(name)
    cfg = load_model_config(path)
    assert get_model_class(cfg) is cls
    assert cfg.rope.partial_rotary_factor == SOURCES[name][1]['partial_rotary_factor'] and cfg.attention_bias
    assert _engine_tokens(path, _prompts()) == want


@pytest.mark.parametrize('name', ['glm', 'glm_mha', 'glm_wide_heads'])
def test_chatglm_decodes_as_the_glm_it_packs(name, source, tmp_path):
    """glm: multi_query_attention with 2 groups (q, k, v one after the other); glm_mha: without it (per head);
    glm_wide_heads: kv_channels 32 over hidden 64 (4 heads)."""
    path, want = source(name)
    converted = glm_to_chatglm(path, str(tmp_path / 'chatglm'))
    cfg = load_model_config(converted)
    assert get_model_class(cfg) is ChatGLMForCausalLM
    kv_heads, head_dim = (4 if name == 'glm_mha' else 2), (32 if name == 'glm_wide_heads' else 16)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (2, kv_heads, head_dim, 49152)
    assert _engine_tokens(converted, _prompts()) == want


def test_chatglm_tp2_equals_transformers(source, tmp_path):
    """Two ranks on gloo, each reading only its heads' rows of query_key_value (reordered for the rotary) and its
    rows of dense_h_to_4h."""
    path, want = source('glm')
    converted = glm_to_chatglm(path, str(tmp_path / 'chatglm'))
    assert _engine_tokens(converted, _prompts(), tp=2) == want


def test_chatglm_rope_ratio_scales_the_base(smollm2_path, tmp_path):
    """glm-4-9b-chat's rope_ratio 500: the base 10000 * rope_ratio (positions past 40 show it)."""
    kwargs = dict(_glm_kwargs(), rope_theta=10000.0 * 500)
    path = build_tiny_custom(str(tmp_path / 'glm_theta'), smollm2_path, 'GlmConfig', kwargs, seed=97)
    converted = glm_to_chatglm(path, str(tmp_path / 'chatglm'), rope_ratio=500)
    assert load_model_config(converted).rope.theta == 5e6
    assert _engine_tokens(converted, _prompts()[2:]) == hf_greedy(path, _prompts()[2:], NEW_TOKENS)


def test_interleaved_order_matches_transformers_rotary():
    """q and k rotated by transformers' Glm apply_rotary_pos_emb, and by the ops' rotate_half after the row order:
    the same vectors up to that order, so the same q.k."""
    from transformers.models.glm.modeling_glm import apply_rotary_pos_emb

    from lmdeploy.devices import get_device
    from lmdeploy.devices.reference import ReferenceOps
    from lmdeploy.engine.model_config import RopeConfig
    from lmdeploy.engine.nn.build import building
    from lmdeploy.engine.nn.rotary import RotaryEmbedding
    d, heads, T = 16, 3, 7
    for partial in (0.5, 0.75, 1.0):
        r = int(d * partial)
        rope = RopeConfig(theta=500.0, partial_rotary_factor=partial)
        pos = torch.arange(T) * 3
        inv = 1.0 / (500.0**(torch.arange(0, r, 2).float() / r))
        freqs = pos[:, None].float() * inv
        emb = torch.cat((freqs, freqs), -1)
        q, k = torch.randn(1, heads, T, d), torch.randn(1, heads, T, d)
        q_hf, k_hf = apply_rotary_pos_emb(q, k, emb.cos()[None], emb.sin()[None])
        order = interleaved_rotary_order(d, r)
        with building(get_device('cpu')):
            ours = RotaryEmbedding(d, rope, 128, partial_layout=True)
        cos, sin = ours.cos_sin(pos, pos + 1)
        q_rows, k_rows = q[0].transpose(0, 1)[..., order], k[0].transpose(0, 1)[..., order]  # [T, heads, d]
        q_ours, k_ours = ReferenceOps.apply_rotary(None, q_rows, k_rows, cos, sin)
        torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1)[..., order])
        torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1)[..., order])


def _chatglm_config(tmp_path, **changes):
    cfg = dict(architectures=['ChatGLMModel'], model_type='chatglm', num_layers=2, hidden_size=64, ffn_hidden_size=128,
               kv_channels=16, num_attention_heads=4, multi_query_attention=True, multi_query_group_num=2,
               padded_vocab_size=100, seq_length=512, layernorm_epsilon=1.5625e-07, rmsnorm=True, add_qkv_bias=True,
               add_bias_linear=False, post_layer_norm=True, apply_residual_connection_post_layernorm=False,
               original_rope=True, rope_ratio=500)
    cfg.update(changes)
    for key in [k for k, v in cfg.items() if v is None]:
        del cfg[key]
    (tmp_path / 'config.json').write_text(json.dumps(cfg))
    return str(tmp_path)


def test_chatglm_config_fields(tmp_path):
    cfg = load_model_config(_chatglm_config(tmp_path))
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.max_position_embeddings) == (2, 64, 128, 4, 2, 16, 100, 512)
    assert cfg.rms_norm_eps == 1.5625e-07 and cfg.rope.theta == 5e6 and cfg.rope.partial_rotary_factor == 0.5
    assert cfg.attention_bias and not cfg.tie_word_embeddings
    # ChatGLM2-6B's defaults: no rope_ratio (base 10000), no multi_query_attention (every head its own KV)
    cfg = load_model_config(_chatglm_config(tmp_path, rope_ratio=None, multi_query_attention=None,
                                            multi_query_group_num=None))
    assert cfg.rope.theta == 10000.0 and cfg.num_kv_heads == 4


@pytest.mark.parametrize('changes,match', [
    (dict(num_layers=None), "field 'num_layers' is missing"),
    (dict(ffn_hidden_size=None), "field 'ffn_hidden_size' is missing"),
    (dict(padded_vocab_size=None), "field 'padded_vocab_size' is missing"),
    (dict(multi_query_group_num=None), "field 'multi_query_group_num' is missing"),
    (dict(rope_ratio=0), "field 'rope_ratio' must be a positive number"),
    (dict(rmsnorm=False), "field 'rmsnorm' is False"),
    (dict(add_bias_linear=True), "field 'add_bias_linear' is True"),
    (dict(post_layer_norm=False), "field 'post_layer_norm' is False"),
    (dict(apply_residual_connection_post_layernorm=True), "'apply_residual_connection_post_layernorm' is True"),
])
def test_bad_chatglm_configs_are_refused(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        load_model_config(_chatglm_config(tmp_path, **changes))


def test_glm_partial_rotary_defaults_to_half(tmp_path):
    """transformers' GlmConfig / Glm4Config take partial_rotary_factor 0.5 when config.json gives none."""
    cfg = dict(architectures=['Glm4ForCausalLM'], model_type='glm4', hidden_size=64, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=100)
    (tmp_path / 'config.json').write_text(json.dumps(cfg))
    assert load_model_config(str(tmp_path)).rope.partial_rotary_factor == 0.5


def test_glm4_builtin_chat_template():
    """``--chat-template glm4`` (LMDeploy's glm4: glm-4-9b-chat's turn markers and stop words; the [gMASK]<sop>
    prefix is the tokenizer's special tokens)."""
    from lmdeploy.frontend.chat_template import ChatTemplateConfig, list_builtin_templates
    assert 'glm4' in list_builtin_templates()
    t = ChatTemplateConfig(model_name='glm4').to_template()
    messages = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'},
                {'role': 'assistant', 'content': 'Hello!'}, {'role': 'user', 'content': 'Bye'}]
    assert t.messages2prompt(messages) == ('<|system|>\nBe brief.<|user|>\nHi<|assistant|>\nHello!'
                                           '<|user|>\nBye<|assistant|>\n')
    assert t.messages2prompt('Bye', sequence_start=False) == '<|user|>\nBye<|assistant|>\n'
    assert t.stop_words == ['<|user|>', '<|endoftext|>', '<|observation|>']
