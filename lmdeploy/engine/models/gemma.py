"""Gemma (v1: ``GemmaForCausalLM``, Gemma 2B / 7B).

Llama's layer with three changes (transformers' models/gemma/modeling_gemma.py):

    x0  = E[ids] * sqrt(hidden)                 the scale a tensor in the model's dtype (bf16: 45.25 for 2048)
    h   = x + Attn(RMSNorm'(x))
    out = h + W_down (gelu_tanh(W_gate h') * W_up h'),  h' = RMSNorm'(h)
    RMSNorm'(x) = (1 + w) * x / rms(x)          the checkpoint stores w around 0 (nn/norm.OffsetRMSNorm)

gelu_tanh is torch's ``gelu(approximate='tanh')``: the official configs say ``hidden_act: "gelu"`` and
``hidden_activation: "gelu_pytorch_tanh"``, and transformers runs both as the tanh approximation. head_dim
comes from the config (256 in 2B and 7B, where 7B has 16 heads of 256 over hidden 3072); the LM head is the
embedding (tied). Gemma 2 and 3 (logit soft-capping, sliding windows, extra norms) are other architectures.
"""
from __future__ import annotations

import torch
from torch import nn

from ..model_config import ModelConfig
from ..nn import LMHead, MergedLinear, RotaryEmbedding, RowParallelLinear, StepContext, VocabEmbedding
from ..nn.activation import GeluTanhAndMul
from ..nn.norm import OffsetRMSNorm
from ..nn.parallel import split_range, tensor_parallel
from .llama import LlamaAttention, LlamaForCausalLM

# activation names that mean tanh-approximated GeLU in a Gemma config (transformers maps the legacy 'gelu')
GELU_TANH = ('gelu_pytorch_tanh', 'gelu')


def check_activation(cfg: ModelConfig):
    act = cfg.raw.get('hidden_activation') or cfg.raw.get('hidden_act') or 'gelu_pytorch_tanh'
    if act not in GELU_TANH:
        raise ValueError(f'Gemma with hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)')


class GemmaMLP(nn.Module):

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        tp = tensor_parallel()
        rows = split_range(cfg.intermediate_size, tp.rank, tp.size)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {'gate': rows, 'up': rows}, bias=cfg.mlp_bias)
        self.act = GeluTanhAndMul()
        self.down_proj = RowParallelLinear(rows, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(self.act.of_projection(self.gate_up_proj, x))


class GemmaDecoderLayer(nn.Module):

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GemmaMLP(cfg)

    def forward(self, x, residual, cos, sin, ctx):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class GemmaModel(nn.Module):

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        self.embed_scale = cfg.hidden_size**0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # as transformers: the float32 sqrt(hidden) rounded to the model's dtype, then the product in it (a
        # host number: no device tensor made per step)
        x = x * float(torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype))
        cos, sin = self.rotary_emb.cos_sin(positions, ctx.rope_lens)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        x, _ = self.norm(x, residual)
        return x


class GemmaForCausalLM(LlamaForCausalLM):
    """Loads by Llama's names (q/k/v and gate/up stacked). The head is the embedding unless config.json says
    ``tie_word_embeddings: false`` (transformers' GemmaConfig defaults it to true; Gemma checkpoints carry no
    lm_head.weight)."""

    def __init__(self, cfg: ModelConfig):
        check_activation(cfg)
        nn.Module.__init__(self)
        self.config = cfg
        self.model = GemmaModel(cfg)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_weights()

    @property
    def tied(self) -> bool:
        return bool(self.config.raw.get('tie_word_embeddings', True))
