"""Llama (2, 3, 3.1, 3.2; also SmolLM2, Yi; Mistral is Llama with its sliding window, mistral.py).

    h   = x + Attn(RMSNorm(x))
    out = h + W_down (silu(W_gate h') * W_up h'),  h' = RMSNorm(h)
    Attn: q, k = RoPE(W_q x), RoPE(W_k x); softmax(q k^T / sqrt(d)) W_v x
"""
from __future__ import annotations

import torch
from torch import nn

from ..model_config import ModelConfig, layer_window
from ..nn import (LMHead, MergedLinear, PagedAttention, RMSNorm, RotaryEmbedding, RowParallelLinear, SiluAndMul,
                  StepContext, VocabEmbedding)
from ..nn.parallel import head_shard, split_range, tensor_parallel
from .base import CausalLM


class LlamaAttention(nn.Module):
    """Under tensor parallelism the rank holds some heads (nn/parallel.py)."""
    qkv_bias_default = False
    window_rule = None  # which layers the config's sliding window applies to (model_config.layer_window)

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        tp = tensor_parallel()
        heads, kv_heads = head_shard(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.size)
        d = self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = len(heads), len(kv_heads)
        q_rows, kv_rows = range(heads.start * d, heads.stop * d), range(kv_heads.start * d, kv_heads.stop * d)
        self.split_sizes = [len(q_rows), len(kv_rows), len(kv_rows)]
        qkv_bias = cfg.attention_bias or self.qkv_bias_default
        self.qkv_proj = MergedLinear(cfg.hidden_size, {'q': q_rows, 'k': kv_rows, 'v': kv_rows}, bias=qkv_bias)
        self.o_proj = RowParallelLinear(q_rows, cfg.hidden_size, bias=cfg.attention_bias)
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                                   **self.attention_options(cfg, layer_idx))

    def attention_options(self, cfg: ModelConfig, layer_idx: int) -> dict:
        """PagedAttention's options for this layer: its sliding window (Gemma2 adds a soft cap and a scale)."""
        return dict(sliding_window=layer_window(cfg, layer_idx, self.window_rule))

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        return q, k

    def forward(self, x: torch.Tensor, cos, sin, ctx: StepContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.qk_norm(q, k)
        return self.o_proj(self.attn(q, k, v, cos, sin, ctx))


class LlamaMLP(nn.Module):
    act_cls = SiluAndMul  # the gate's activation (Gemma: GeLU-tanh)
    feeds = (('act', 'down_proj'), )  # (producer, consumer) of forward: nn/feeds.py

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        tp = tensor_parallel()
        rows = split_range(cfg.intermediate_size, tp.rank, tp.size)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {'gate': rows, 'up': rows}, bias=cfg.mlp_bias)
        self.act = self.act_cls()
        self.down_proj = RowParallelLinear(rows, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(self.act.of_projection(self.gate_up_proj, x))


class LlamaDecoderLayer(nn.Module):
    norm_cls, mlp_cls = RMSNorm, LlamaMLP
    # (producer, consumer) of forward: the norm's output is the projection's whole input (nn/feeds.py)
    feeds = (('input_layernorm', 'self_attn.qkv_proj'), ('post_attention_layernorm', 'mlp.gate_up_proj'))

    def __init__(self, cfg: ModelConfig, layer_idx: int, attention_cls=LlamaAttention):
        super().__init__()
        self.input_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg, layer_idx)
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.mlp_cls(cfg)

    def forward(self, x, residual, cos, sin, ctx):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig, attention_cls=LlamaAttention):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i, attention_cls) for i in range(cfg.num_layers))
        self.norm = self.layer_cls.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def cos_sin(self, positions: torch.Tensor, ctx: StepContext):
        """The rotary tables of the step's positions; (None, None) for a model without rotary (ALiBi)."""
        if self.rotary_emb is None:
            return None, None
        return self.rotary_emb.cos_sin(positions, ctx.rope_lens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.cos_sin(positions, ctx)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    """Variants differ in their attention block (Qwen) or their layers' norms and MLP (Gemma)."""
    attention_cls = LlamaAttention
    model_cls = LlamaModel
    stacked_params = [('qkv_proj', 'q_proj', 'q'), ('qkv_proj', 'k_proj', 'k'), ('qkv_proj', 'v_proj', 'v'),
                      ('gate_up_proj', 'gate_proj', 'gate'), ('gate_up_proj', 'up_proj', 'up')]

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.model_cls(cfg, self.attention_cls)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Final hidden states [T, hidden]; logits come from compute_logits."""
        return self.model(input_ids, positions, ctx)
