"""InternLM3: Llama's layout and names; config.json's ``qkv_bias`` puts biases on q, k and v, its ``bias`` on
o_proj and the MLP (as InternLM's modeling_internlm3.py builds them); ``head_dim`` may be given."""
from __future__ import annotations

import dataclasses

from ..model_config import ConfigFields, ModelConfig
from ..nn import RowParallelLinear
from .llama import LlamaAttention, LlamaForCausalLM


def _flag(cfg: ModelConfig, key: str) -> bool:
    return ConfigFields(cfg.raw, 'config.json').flag(key, False)


class InternLM3Attention(LlamaAttention):
    """q, k, v biased by ``qkv_bias`` (Llama's attention_bias here), o_proj by ``bias``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.o_proj = RowParallelLinear(self.o_proj.cols, cfg.hidden_size, bias=_flag(cfg, 'bias'))


class InternLM3ForCausalLM(LlamaForCausalLM):
    attention_cls = InternLM3Attention

    def __init__(self, cfg: ModelConfig):
        super().__init__(dataclasses.replace(cfg, attention_bias=_flag(cfg, 'qkv_bias'), mlp_bias=_flag(cfg, 'bias')))
