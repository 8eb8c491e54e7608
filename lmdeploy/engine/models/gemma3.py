"""Gemma 3, text only (``Gemma3ForCausalLM``, model_type ``gemma3_text``: gemma-3-1b and the text towers saved
on their own): Gemma 2's layer (gemma2.py) with three changes (transformers' models/gemma3/modeling_gemma3.py):

    q, k = RMSNorm'_q(W_q x), RMSNorm'_k(W_k x)   per head over head_dim, (1 + w) like every Gemma norm,
                                                  before the rotary embedding
    local layers attend within ``sliding_window``: those ``layer_types`` marks, else all but every
        ``sliding_window_pattern``-th (default 6: five local layers to one global)
    rotary base: local layers ``rope_local_base_freq`` (default 10,000), global layers ``rope_theta``
        (default 1e6) with ``rope_scaling`` (4B+: linear, factor 8); transformers 5 writes both as
        ``rope_parameters.{sliding,full}_attention``

Soft caps are usually null in Gemma 3 (honoured where a config sets them, as Gemma 2 does); scores are scaled
by ``query_pre_attn_scalar``^-0.5. The multimodal ``Gemma3ForConditionalGeneration`` is refused in the model
registry (models/__init__.py): its weights sit under the language model's prefix beside a vision tower.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..model_config import ConfigFields, ModelConfig, RopeConfig, _rope_from
from ..nn import RotaryEmbedding, StepContext
from ..nn.norm import OffsetRMSNorm
from .gemma2 import Gemma2Attention, Gemma2ForCausalLM, Gemma2Model

SLIDING, FULL = 'sliding_attention', 'full_attention'
# transformers' Gemma3TextConfig.default_theta: the bases a config that names none gets
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def gemma3_layer_types(cfg: ModelConfig) -> List[str]:
    """Each layer's kind, as Gemma3TextConfig derives it: ``layer_types`` where config.json lists them (hub
    configs written before it existed give ``sliding_window_pattern`` instead), else layer i slides unless
    (i + 1) is a multiple of the pattern."""
    fields = ConfigFields(cfg.raw, 'config.json')
    types = cfg.raw.get('layer_types')
    if types is None:
        pattern = fields.integer('sliding_window_pattern', None) or fields.integer('_sliding_window_pattern', 6)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(cfg.num_layers)]
    if not isinstance(types, list) or len(types) != cfg.num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise fields.error('layer_types', f"must list '{SLIDING}' or '{FULL}' for each of the {cfg.num_layers} "
                           f'layers, got {types!r}')
    return list(types)


def gemma3_ropes(cfg: ModelConfig) -> Dict[str, RopeConfig]:
    """The rotary settings of each layer kind. Read through model_config's rope reader (so the same types are
    supported and the same errors raised), one kind at a time."""
    raw = cfg.raw
    nested = raw.get('rope_parameters')
    if isinstance(nested, dict) and any(isinstance(v, dict) for v in nested.values()):
        per_kind = {}
        for kind in (SLIDING, FULL):
            params = dict(nested.get(kind) or {'rope_type': 'default'})
            params.setdefault('rope_theta', DEFAULT_THETA[kind])
            per_kind[kind] = {'rope_parameters': params}
    else:  # hub configs: rope_theta and rope_scaling for the global layers, rope_local_base_freq for the local
        per_kind = {FULL: {'rope_theta': raw.get('rope_theta') or DEFAULT_THETA[FULL],
                           'rope_scaling': raw.get('rope_scaling')},
                    SLIDING: {'rope_theta': raw.get('rope_local_base_freq') or DEFAULT_THETA[SLIDING]}}
    return {kind: _rope_from(ConfigFields(values, 'config.json')) for kind, values in per_kind.items()}


class Gemma3Attention(Gemma2Attention):

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        self.layer_type = gemma3_layer_types(cfg)[layer_idx]
        super().__init__(cfg, layer_idx)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def attention_options(self, cfg: ModelConfig, layer_idx: int) -> dict:
        options = super().attention_options(cfg, layer_idx)
        options['sliding_window'] = cfg.sliding_window if self.layer_type == SLIDING else None
        return options

    def qk_norm(self, q, k):
        d = self.head_dim
        return self.q_norm(q.reshape(-1, d)).view_as(q), self.k_norm(k.reshape(-1, d)).view_as(k)


class Gemma3Model(Gemma2Model):
    """One rotary embedding per layer kind; each step computes both cos/sin pairs once and hands every layer
    its kind's pair."""

    def __init__(self, cfg: ModelConfig, attention_cls=Gemma3Attention):
        super().__init__(cfg, attention_cls)
        ropes = gemma3_ropes(cfg)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, ropes[FULL], cfg.max_position_embeddings)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, ropes[SLIDING], cfg.max_position_embeddings)
        self.layer_types = gemma3_layer_types(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embed(input_ids)
        rotary = {FULL: self.rotary_emb, SLIDING: self.rotary_local}
        cos_sin = {kind: rotary[kind].cos_sin(positions, ctx.rope_lens) for kind in set(self.layer_types)}
        residual = None
        for kind, layer in zip(self.layer_types, self.layers):
            x, residual = layer(x, residual, *cos_sin[kind], ctx)
        x, _ = self.norm(x, residual)
        return x


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_cls = Gemma3Attention
    model_cls = Gemma3Model

    def __init__(self, cfg: ModelConfig):
        if ConfigFields(cfg.raw, 'config.json').flag('use_bidirectional_attention', False):
            raise ValueError('Gemma 3 with use_bidirectional_attention (an embedding model) is not supported: '
                             'this engine decodes causally')
        super().__init__(cfg)
