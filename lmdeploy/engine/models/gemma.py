"""Gemma (v1: ``GemmaForCausalLM``, Gemma 2B / 7B).

Llama's layer with three changes (transformers' models/gemma/modeling_gemma.py):

    x0  = E[ids] * sqrt(hidden)                 the scale a tensor in the model's dtype (bf16: 45.25 for 2048)
    h   = x + Attn(RMSNorm'(x))
    out = h + W_down (gelu_tanh(W_gate h') * W_up h'),  h' = RMSNorm'(h)
    RMSNorm'(x) = (1 + w) * x / rms(x)          the checkpoint stores w around 0 (nn/norm.OffsetRMSNorm)

gelu_tanh is torch's ``gelu(approximate='tanh')``: the official configs say ``hidden_act: "gelu"`` and
``hidden_activation: "gelu_pytorch_tanh"``, and transformers runs both as the tanh approximation. head_dim
comes from the config (256 in 2B and 7B, where 7B has 16 heads of 256 over hidden 3072); the LM head is the
embedding (tied). Gemma 2 (gemma2.py) builds on these classes.
"""
from __future__ import annotations

import torch

from ..model_config import ModelConfig
from ..nn.activation import GeluTanhAndMul
from ..nn.norm import OffsetRMSNorm
from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

# activation names that mean tanh-approximated GeLU in a Gemma config (transformers maps the legacy 'gelu')
GELU_TANH = ('gelu_pytorch_tanh', 'gelu')


def check_activation(cfg: ModelConfig):
    act = cfg.raw.get('hidden_activation') or cfg.raw.get('hidden_act') or 'gelu_pytorch_tanh'
    if act not in GELU_TANH:
        raise ValueError(f'Gemma with hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)')


class GemmaMLP(LlamaMLP):
    act_cls = GeluTanhAndMul


class GemmaDecoderLayer(LlamaDecoderLayer):
    norm_cls, mlp_cls = OffsetRMSNorm, GemmaMLP


class GemmaModel(LlamaModel):
    layer_cls = GemmaDecoderLayer

    def __init__(self, cfg: ModelConfig, attention_cls=LlamaAttention):
        super().__init__(cfg, attention_cls)
        self.embed_scale = cfg.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # as transformers: the float32 sqrt(hidden) rounded to the model's dtype, then the product in it (a
        # host number: no device tensor made per step)
        return x * float(torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype))


class GemmaForCausalLM(LlamaForCausalLM):
    """Loads by Llama's names (q/k/v and gate/up stacked). The head is the embedding unless config.json says
    ``tie_word_embeddings: false`` (transformers' GemmaConfig defaults it to true; Gemma checkpoints carry no
    lm_head.weight)."""

    model_cls = GemmaModel

    def __init__(self, cfg: ModelConfig):
        check_activation(cfg)
        super().__init__(cfg)

    @property
    def tied(self) -> bool:
        return bool(self.config.raw.get('tie_word_embeddings', True))
