"""Qwen2 / Qwen2.5 (Llama with biased q/k/v) and Qwen3 (Llama with per-head
RMSNorm on q and k before RoPE). Both take the sliding window where ``use_sliding_window`` is true, on the
layers ``layer_types`` marks or from ``max_window_layers`` on (model_config.layer_window)."""
from __future__ import annotations

from ..model_config import ModelConfig
from ..nn import RMSNorm
from .llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    qkv_bias_default = True
    window_rule = 'layer_types'


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention


class Qwen3Attention(LlamaAttention):
    window_rule = 'layer_types'

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qk_norm(self, q, k):
        d = self.head_dim
        return self.q_norm(q.reshape(-1, d)).view_as(q), self.k_norm(k.reshape(-1, d)).view_as(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
