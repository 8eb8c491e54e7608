"""Gemma 2 (``Gemma2ForCausalLM``): Gemma's layer (gemma.py) with four norms, a scale of its own, soft-capped
attention scores and logits, and sliding-window attention on alternate layers (transformers'
models/gemma2/modeling_gemma2.py):

    h   = x + RMSNorm'_post_attn(Attn(RMSNorm'_in(x)))
    out = h + RMSNorm'_post_ffw(MLP(RMSNorm'_pre_ffw(h)))
    Attn: scores (q . k) / sqrt(query_pre_attn_scalar), then c tanh(s / c) (attn_logit_softcapping c)
    logits = c' tanh(W_head h_final / c')                 (final_logit_softcapping c')

Layers marked ``sliding_attention`` in ``layer_types`` (by default the even ones) attend within
``sliding_window`` tokens (model_config.layer_window). Both soft caps may be null (off).
"""
from __future__ import annotations

import torch

from ..model_config import ConfigFields, ModelConfig, layer_window
from ..nn.norm import OffsetRMSNorm
from .gemma import GemmaDecoderLayer, GemmaForCausalLM, GemmaModel
from .llama import LlamaAttention


def _fields(cfg: ModelConfig) -> ConfigFields:
    return ConfigFields(cfg.raw, 'config.json')


class Gemma2Attention(LlamaAttention):
    window_rule = 'alternate'

    def attention_options(self, cfg: ModelConfig, layer_idx: int) -> dict:
        f = _fields(cfg)
        return dict(sliding_window=layer_window(cfg, layer_idx, self.window_rule),
                    logit_softcap=f.number('attn_logit_softcapping', None),
                    scale=f.number('query_pre_attn_scalar', 256.0)**-0.5)  # (transformers' default)


class Gemma2DecoderLayer(GemmaDecoderLayer):
    """The running (x, residual) pair as Llama's: the hidden state is their sum, the adds fused into the
    norms that take a residual; the post-norms take none (they norm a sublayer's output alone)."""
    feeds = (('input_layernorm', 'self_attn.qkv_proj'), ('pre_feedforward_layernorm', 'mlp.gate_up_proj'))

    def __init__(self, cfg: ModelConfig, layer_idx: int, attention_cls=Gemma2Attention):
        super().__init__(cfg, layer_idx, attention_cls)
        self.pre_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, ctx):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, cos, sin, ctx))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2Model(GemmaModel):
    layer_cls = Gemma2DecoderLayer


class Gemma2ForCausalLM(GemmaForCausalLM):
    attention_cls = Gemma2Attention
    model_cls = Gemma2Model

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.final_softcap = _fields(cfg).number('final_logit_softcapping', None)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.final_softcap is None:
            return logits
        cap = self.final_softcap
        return torch.tanh(logits / cap) * cap
