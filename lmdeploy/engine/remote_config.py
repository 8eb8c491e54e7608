"""Config fields of checkpoints whose config class is not transformers' (remote code), read under the names
load_model_config reads, and transformers' defaults that a config.json leaves implicit.

Each reader takes the raw config.json object and returns it with the standard names added (the checkpoint's
own fields kept, so a model may read them from ``ModelConfig.raw``); a field the layout needs that is
missing or malformed raises ValueError naming the checkpoint's own field.

* ChatGLM (``model_type: chatglm``: ChatGLM2 / ChatGLM3, THUDM's glm-4-9b-chat; configuration_chatglm.py):
  ``num_layers``, ``ffn_hidden_size``, ``padded_vocab_size`` (the embedding's and the output layer's rows),
  ``kv_channels`` (head_dim; hidden / heads without it), ``multi_query_attention`` with
  ``multi_query_group_num`` (the KV heads; all heads without it), ``layernorm_epsilon`` (1e-5 by default),
  ``seq_length`` (the trained length), ``add_qkv_bias``, ``rope_ratio`` (the rotary base is 10000 * rope_ratio,
  as ChatGLM3's and glm-4-9b-chat's modeling_chatglm.py compute it). The rotary embedding covers half of each
  head (``RotaryEmbedding(rotary_dim // 2)`` over head_dim) on interleaved pairs. ``original_rope`` is stored
  by the modeling file but changes nothing there, so either value is taken. Layouts the model does not
  implement are refused by name: ``rmsnorm: false`` (LayerNorm), ``apply_residual_connection_post_layernorm``,
  ``post_layer_norm: false``, ``add_bias_linear`` (biases on every linear map).
  ChatGLM2-6B-32K's modeling file reads ``rope_ratio`` otherwise (positions divided by it) with the same
  config fields; it is read here as the later checkpoints read it.
* Baichuan (``model_type: baichuan``): Baichuan2-13B's config.json has no ``max_position_embeddings``, only
  ``model_max_length``.
* GLM (``model_type: glm`` / ``glm4``): transformers' GlmConfig / Glm4Config default ``partial_rotary_factor``
  to 0.5 when the config does not give one.
* StarCoder2 (``model_type: starcoder2``, transformers' Starcoder2Config): ``norm_epsilon`` (1e-5) is the
  LayerNorms' eps, ``use_bias`` (true) puts biases on every linear map; the embedding is tied unless
  ``tie_word_embeddings`` says otherwise.
* Falcon (``model_type: falcon``, transformers' FalconConfig): ``ffn_hidden_size`` (4 x hidden), the KV heads
  by layout (``new_decoder_architecture``: ``num_kv_heads``; else one with ``multi_query``, all heads
  without), ``layer_norm_epsilon`` (1e-5), ``bias`` on every linear map, a tied embedding by default;
  the older names ``n_embed`` / ``n_head`` / ``n_layer`` / ``n_head_kv`` read too; ``alibi`` (falcon-rw) is the
  model's (models/falcon.py). ``apply_residual_connection_post_layernorm`` is refused.
"""
from __future__ import annotations

from typing import Any, Dict


def chatglm_fields(cfg: Dict[str, Any], path: str) -> Dict[str, Any]:
    from .model_config import ConfigFields
    f = ConfigFields(cfg, path)
    for key, implemented in (('rmsnorm', True), ('apply_residual_connection_post_layernorm', False),
                             ('post_layer_norm', True), ('add_bias_linear', False)):
        if f.flag(key, implemented) != implemented:
            raise f.error(key, f'is {not implemented}: ChatGLM checkpoints with {key}={not implemented} are not '
                          f'supported (only {key}={implemented}, as ChatGLM2/3 and GLM-4 have)')
    f.flag('original_rope', True)
    heads = f.integer('num_attention_heads', what='the number of attention heads, a positive integer')
    hidden = f.integer('hidden_size', what="the model's width, a positive integer")
    head_dim = f.integer('kv_channels', None, what='the head dimension, a positive integer')
    if head_dim is None:
        if hidden % heads:
            raise f.error('kv_channels', f'is missing and hidden_size ({hidden}) is not a multiple of '
                          f'num_attention_heads ({heads})')
        head_dim = hidden // heads
    if head_dim % 4:
        raise f.error('kv_channels', f'must be a multiple of 4 (rotary on interleaved pairs of half of each head), '
                      f'got {head_dim}')
    kv_heads = heads
    if f.flag('multi_query_attention', False):
        kv_heads = f.integer('multi_query_group_num',
                             what='the number of KV heads, a positive integer, with multi_query_attention')
    out = dict(cfg)
    out.update(
        num_hidden_layers=f.integer('num_layers', what='the number of decoder layers, a positive integer'),
        intermediate_size=f.integer('ffn_hidden_size', what="the MLP's width, a positive integer"),
        vocab_size=f.integer('padded_vocab_size', what='the rows of the embedding and the output layer, a '
                             'positive integer'),
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.number('layernorm_epsilon', 1e-5),
        max_position_embeddings=f.integer('seq_length', 2048, what='the trained length, a positive integer'),
        attention_bias=f.flag('add_qkv_bias', False),
        rope_theta=10000.0 * f.number('rope_ratio', 1.0),
        partial_rotary_factor=0.5,
        tie_word_embeddings=False,
    )
    for key in ('rope_scaling', 'rope_parameters'):  # modeling_chatglm.py reads neither
        out.pop(key, None)
    return out


def baichuan_fields(cfg: Dict[str, Any], path: str) -> Dict[str, Any]:
    from .model_config import ConfigFields
    if cfg.get('max_position_embeddings') is not None:
        return cfg
    f = ConfigFields(cfg, path)
    return dict(cfg, max_position_embeddings=f.integer('model_max_length', 4096))


def glm_fields(cfg: Dict[str, Any], path: str) -> Dict[str, Any]:
    params = cfg.get('rope_parameters') or cfg.get('rope_scaling') or {}
    given = cfg.get('partial_rotary_factor') is not None or (isinstance(params, dict)
                                                               and params.get('partial_rotary_factor') is not None)
    return cfg if given else dict(cfg, partial_rotary_factor=0.5)


def starcoder2_fields(cfg: Dict[str, Any], path: str) -> Dict[str, Any]:
    from .model_config import ConfigFields
    f = ConfigFields(cfg, path)
    bias = f.flag('use_bias', True)
    return dict(cfg, rms_norm_eps=f.number('norm_epsilon', 1e-5), attention_bias=bias, mlp_bias=bias,
                tie_word_embeddings=f.flag('tie_word_embeddings', True))


def falcon_fields(cfg: Dict[str, Any], path: str) -> Dict[str, Any]:
    from .model_config import ConfigFields
    f = ConfigFields(cfg, path)
    if f.flag('apply_residual_connection_post_layernorm', False):
        raise f.error('apply_residual_connection_post_layernorm', 'is true: not supported (only false, as '
                      "transformers' Falcon has it)")
    out = dict(cfg)
    for new, old in (('hidden_size', 'n_embed'), ('num_attention_heads', 'n_head'),
                     ('num_hidden_layers', 'n_layer'), ('num_kv_heads', 'n_head_kv')):
        if out.get(new) is None and out.get(old) is not None:
            out[new] = out[old]
    f = ConfigFields(out, path)
    heads = f.integer('num_attention_heads', what='the number of attention heads, a positive integer')
    hidden = f.integer('hidden_size', what="the model's width, a positive integer")
    if hidden % heads:
        raise f.error('hidden_size', f'({hidden}) must be a multiple of num_attention_heads ({heads})')
    if f.flag('new_decoder_architecture', False):
        kv_heads = f.integer('num_kv_heads', heads)
    elif f.flag('multi_query', True):
        kv_heads = 1
    else:
        kv_heads = heads
        if f.integer('num_kv_heads', heads) != heads:
            raise f.error('num_kv_heads', f'must equal num_attention_heads ({heads}) without multi_query or '
                          'new_decoder_architecture (the packed query_key_value holds every head\'s k and v)')
    bias = f.flag('bias', False)
    out.update(num_key_value_heads=kv_heads, head_dim=hidden // heads,
               intermediate_size=f.integer('ffn_hidden_size', 4 * hidden),
               rms_norm_eps=f.number('layer_norm_epsilon', 1e-5), attention_bias=bias, mlp_bias=bias,
               max_position_embeddings=f.integer('max_position_embeddings', 2048),
               tie_word_embeddings=f.flag('tie_word_embeddings', True))
    return out


READERS = {'starcoder2': starcoder2_fields, 'falcon': falcon_fields, 'chatglm': chatglm_fields, 'baichuan': baichuan_fields, 'glm': glm_fields, 'glm4': glm_fields}


def standard_fields(cfg: Dict[str, Any], path: str) -> Dict[str, Any]:
    """``cfg`` with the standard names of its model type's own fields (unchanged for other types)."""
    reader = READERS.get(cfg.get('model_type'))
    return cfg if reader is None else reader(cfg, path)
