"""StarCoder2 (``Starcoder2ForCausalLM``): Llama's layer with LayerNorms, an ungated GELU MLP and biases.

    h   = x + Attn(LN(x))                        LN: LayerNorm with a bias, eps ``norm_epsilon``
    out = h + c_proj(gelu(c_fc(LN(h))))          gelu as ``hidden_act`` names it (gelu_pytorch_tanh)
    Attn: Llama's (GQA, rotary on whole heads), biases on q, k, v and o with ``use_bias``; every layer
          attends within ``sliding_window`` where the config sets one (transformers' Starcoder2 masks so)

transformers' models/starcoder2/modeling_starcoder2.py; config fields read by engine/remote_config.py. The
checkpoint's names are these classes' (q_proj, k_proj, v_proj stacked into qkv_proj on load). Falcon
(falcon.py) takes the MLP.
"""
from __future__ import annotations

from torch import nn

from ..model_config import ModelConfig
from ..nn import MergedLinear, RowParallelLinear
from ..nn.activation import Gelu
from ..nn.layer_norm import LayerNorm
from ..nn.parallel import split_range, tensor_parallel
from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GeluMLP(nn.Module):
    """c_proj(gelu(c_fc x)): c_fc's rows and c_proj's columns split over the ranks (c_fc a stack of one
    unnamed checkpoint tensor)."""
    feeds = (('act', 'c_proj'), )  # (producer, consumer) of forward: nn/feeds.py

    def __init__(self, cfg: ModelConfig, act_name: str):
        super().__init__()
        rows = split_range(cfg.intermediate_size, tensor_parallel().rank, tensor_parallel().size)
        self.c_fc = MergedLinear(cfg.hidden_size, {'': rows}, bias=cfg.mlp_bias)
        self.act = Gelu(act_name)
        self.c_proj = RowParallelLinear(rows, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Starcoder2MLP(GeluMLP):

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, cfg.raw.get('hidden_act') or 'gelu_pytorch_tanh')


class Starcoder2Attention(LlamaAttention):
    window_rule = 'all'


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    norm_cls, mlp_cls = LayerNorm, Starcoder2MLP
    feeds = (('input_layernorm', 'self_attn.qkv_proj'), ('post_attention_layernorm', 'mlp.c_fc'))


class Starcoder2Model(LlamaModel):
    layer_cls = Starcoder2DecoderLayer


class Starcoder2ForCausalLM(LlamaForCausalLM):
    attention_cls = Starcoder2Attention
    model_cls = Starcoder2Model
    stacked_params = [('qkv_proj', 'q_proj', 'q'), ('qkv_proj', 'k_proj', 'k'), ('qkv_proj', 'v_proj', 'v')]
