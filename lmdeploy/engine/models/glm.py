"""GLM-4: ``GlmForCausalLM`` (glm-4-9b-chat-hf), ``Glm4ForCausalLM`` (GLM-4-0414) and the ``ChatGLMModel`` layout
of THUDM's remote-code checkpoints (ChatGLM2 / ChatGLM3, glm-4-9b-chat).

    Glm:   h   = x + Attn(RMSNorm(x))
           out = h + W_down (silu(W_gate h') * W_up h'),       h' = RMSNorm(h)
    Glm4:  h   = x + RMSNorm_a(Attn(RMSNorm(x)))               (post-norms on both branches)
           out = h + RMSNorm_m(W_down (silu(W_gate h') * W_up h'))
    Attn:  q, k, v = W_q x + b_q, W_k x + b_k, W_v x (+ b_v)   (``attention_bias``: q, k, v only; o never)
           rotary on the first R = head_dim * partial_rotary_factor dims of each q and k head (0.5 by default),
           on the interleaved pairs (2i, 2i + 1), pair i turned by position * theta^(-2i / R)

The ops rotate whole heads on the pairs (j, j + head_dim / 2), so each q and k head's rows are reordered on load
(nn/rotary.interleaved_rotary_order): even dims of the rotary part, then odd ones, placed where the ops rotate,
the pass-through dims where the rotary embedding gives cos 1, sin 0. q and k reordered alike leave every q.k.
``gate_up_proj`` holds the gate rows, then the up rows (transformers' GlmMLP chunks it so).

ChatGLM's checkpoint names (modeling_chatglm.py; the config's own fields are read by engine/remote_config.py):

    transformer.embedding.word_embeddings       model.embed_tokens
    transformer.encoder.layers.N.               model.layers.N.
    self_attention.query_key_value              q, k, v: [heads, kv, kv] x head_dim rows one after the other
                                                with multi_query_attention; without it, per head its q, k, v
    self_attention.dense                        self_attn.o_proj
    mlp.dense_h_to_4h, mlp.dense_4h_to_h        gate_up_proj (gate rows, then up: swiglu chunks so), down_proj
    transformer.encoder.final_layernorm         model.norm
    transformer.output_layer                    lm_head

which is Glm's computation: transformers' GLM conversion script (models/glm/convert_glm_weights_to_hf.py) maps
glm-4-9b-chat's tensors onto GlmForCausalLM's so, and rotates half of each head on interleaved pairs as
modeling_chatglm.py's apply_rotary_pos_emb does.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Tuple

import torch

from ..model_config import ModelConfig
from ..nn import RMSNorm
from ..nn.loading import CheckpointTensor
from ..nn.rotary import RotaryEmbedding, interleaved_rotary_order, rotary_partial_dim
from .internlm2 import unpack_wqkv
from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .phi3 import HeadPermuted, split_rows


class GlmAttention(LlamaAttention):
    """Llama's attention with biases on q, k and v (``attention_bias``), none on o_proj."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        self.qkv_bias_default = cfg.attention_bias  # a plain attribute: read by LlamaAttention.__init__
        super().__init__(dataclasses.replace(cfg, attention_bias=False), layer_idx)


class Glm4DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with an RMSNorm on the attention's and on the MLP's output before each residual add."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, attention_cls=GlmAttention):
        super().__init__(cfg, layer_idx, attention_cls)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, ctx):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(x, cos, sin, ctx))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual  # added to the residual by the next norm


class Glm4Model(LlamaModel):
    layer_cls = Glm4DecoderLayer


class GlmForCausalLM(LlamaForCausalLM):
    attention_cls = GlmAttention

    def __init__(self, cfg: ModelConfig):
        # Llama's rotary embedding (replaced below) refuses partial rotary; this model lays q and k out for it
        plain = dataclasses.replace(cfg.rope, partial_rotary_factor=1.0)
        super().__init__(dataclasses.replace(cfg, rope=plain))
        self.config = cfg
        self.rotary_dim = rotary_partial_dim(cfg.head_dim, cfg.rope)
        self.model.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings,
                                                partial_layout=True)
        self.qk_order = interleaved_rotary_order(cfg.head_dim, self.rotary_dim)

    def glm_names(self, weights: Iterable[Tuple[str, CheckpointTensor]]) -> Iterator[Tuple[str, object]]:
        """The checkpoint's tensors under transformers' Glm names (ChatGLM renames)."""
        return weights

    def checkpoint_names(self, weights: Iterable[Tuple[str, CheckpointTensor]]) -> Iterator[Tuple[str, object]]:
        """Glm's tensors as Llama's: gate_up_proj into gate_proj and up_proj; q_proj and k_proj (weights and
        biases) with each head's rows in the ops' rotary order."""
        cfg = self.config
        for name, src in self.glm_names(weights):
            if isinstance(src, torch.Tensor):
                src = CheckpointTensor(src)
            if '.mlp.gate_up_proj.' in name:
                prefix, param = name.split('.mlp.gate_up_proj.')
                sizes = {'gate': cfg.intermediate_size, 'up': cfg.intermediate_size}
                for part, rows in split_rows(src, sizes, name).items():
                    yield f'{prefix}.mlp.{part}_proj.{param}', rows
            elif '.self_attn.q_proj.' in name or '.self_attn.k_proj.' in name:
                yield name, HeadPermuted(src, cfg.head_dim, self.qk_order)
            else:
                yield name, src

    def load_weights(self, weights: Iterable[Tuple[str, CheckpointTensor]]):
        super().load_weights(self.checkpoint_names(weights))


class Glm4ForCausalLM(GlmForCausalLM):
    model_cls = Glm4Model


# ChatGLM checkpoint name part -> Glm's
CHATGLM_RENAMES = (('transformer.embedding.word_embeddings.', 'model.embed_tokens.'),
                   ('transformer.encoder.layers.', 'model.layers.'),
                   ('transformer.encoder.final_layernorm.', 'model.norm.'),
                   ('transformer.output_layer.', 'lm_head.'), ('.self_attention.dense.', '.self_attn.o_proj.'),
                   ('.mlp.dense_h_to_4h.', '.mlp.gate_up_proj.'), ('.mlp.dense_4h_to_h.', '.mlp.down_proj.'))


class ChatGLMForCausalLM(GlmForCausalLM):
    """The ``ChatGLMModel`` layout (config.json's ``architectures`` ChatGLMModel or
    ChatGLMForConditionalGeneration, ``model_type: chatglm``)."""

    ignored_weights = ('rotary_emb.inv_freq', 'rotary_pos_emb.inv_freq')

    def glm_names(self, weights: Iterable[Tuple[str, CheckpointTensor]]) -> Iterator[Tuple[str, object]]:
        cfg = self.config
        d, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        consecutive = bool(cfg.raw.get('multi_query_attention'))
        for name, src in weights:
            if isinstance(src, torch.Tensor):
                src = CheckpointTensor(src)
            for old, new in CHATGLM_RENAMES:
                name = name.replace(old, new)
            if '.self_attention.query_key_value.' in name:
                prefix, param = name.split('.self_attention.query_key_value.')
                if consecutive:
                    parts = split_rows(src, {'q': heads * d, 'k': kv_heads * d, 'v': kv_heads * d}, name)
                else:  # [heads, 3 * head_dim] rows: each head's q, k, v (a KV group of one query head)
                    parts = unpack_wqkv(src, heads, heads, d, name)
                for part, rows in parts.items():
                    yield f'{prefix}.self_attn.{part}_proj.{param}', rows
            else:
                yield name, src
