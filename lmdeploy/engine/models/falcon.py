"""Falcon (``FalconForCausalLM``, transformers' ``falcon``): rotary attention and a GELU MLP on LayerNorms, in
parallel or one after the other, with one of three packings of ``query_key_value``.

    parallel (``parallel_attn``, always with ``new_decoder_architecture``):
        out = x + (MLP(LN_m(x)) + Attn(LN_a(x)))     LN_a = ln_attn, LN_m = ln_mlp where the layer has two
                                                     (new architecture, ``num_ln_in_parallel_attn`` 2, its
                                                     default), else both input_layernorm
    sequential: h = x + Attn(input_layernorm(x)); out = h + MLP(post_attention_layernorm(h))
    MLP: dense_4h_to_h(gelu(dense_h_to_4h x)) (``activation``, erf ``gelu`` by default); ``bias`` on every
    linear map; the LM head is the embedding unless ``tie_word_embeddings`` is false

``query_key_value``'s rows, as transformers' FalconAttention._split_heads reads them:

    new_decoder_architecture   per KV head: its G = heads / kv_heads query heads, its k, its v (InternLM2's
                               wqkv layout: internlm2.unpack_wqkv); query head h uses KV head h // G
    multi_query                all query heads, then one k head, then one v head
    neither                    per head: its q, k, v (G = 1 of the layout above)

``alibi`` (falcon-rw): no rotary; ALiBi biases scaled with the scores, as transformers' SDPA path does
(models/alibi.py). engine/remote_config.py reads Falcon's field names.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Tuple

import torch
from torch import nn

from ..model_config import ConfigFields, ModelConfig
from ..nn.layer_norm import LayerNorm
from ..nn.loading import CheckpointTensor
from .alibi import ScaledAlibiAttention, drop_rotary
from .internlm2 import unpack_wqkv
from .llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from .phi3 import split_rows
from .starcoder2 import GeluMLP


def layout(cfg: ModelConfig) -> Tuple[bool, bool, bool]:
    """(new decoder architecture, parallel attention and MLP, two norms in the layer)."""
    f = ConfigFields(cfg.raw, 'config.json')
    new = f.flag('new_decoder_architecture', False)
    parallel = new or f.flag('parallel_attn', True)
    two = new and f.integer('num_ln_in_parallel_attn', 2) == 2
    return new, parallel, two


class FalconMLP(GeluMLP):

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, cfg.raw.get('activation') or 'gelu')


class FalconDecoderLayer(nn.Module):
    norm_cls = LayerNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int, attention_cls=LlamaAttention):
        super().__init__()
        _, self.parallel, two = layout(cfg)
        eps = cfg.rms_norm_eps
        if two:
            self.ln_attn, self.ln_mlp = LayerNorm(cfg.hidden_size, eps), LayerNorm(cfg.hidden_size, eps)
        else:
            self.input_layernorm = LayerNorm(cfg.hidden_size, eps)
            if not self.parallel:
                self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.self_attn = attention_cls(cfg, layer_idx)
        self.mlp = FalconMLP(cfg)

    def forward(self, x, cos, sin, ctx):
        if not self.parallel:
            h = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
            return h + self.mlp(self.post_attention_layernorm(h))
        if hasattr(self, 'ln_attn'):
            a, m = self.ln_attn(x), self.ln_mlp(x)
        else:
            a = m = self.input_layernorm(x)
        attn = self.self_attn(a, cos, sin, ctx)
        return x + (self.mlp(m) + attn)  # transformers' order of the sums


class FalconModel(LlamaModel):
    layer_cls = FalconDecoderLayer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.cos_sin(positions, ctx)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)


# checkpoint name part -> here
RENAMES = (('transformer.word_embeddings.', 'model.embed_tokens.'), ('transformer.h.', 'model.layers.'),
           ('transformer.ln_f.', 'model.norm.'), ('.self_attention.dense.', '.self_attn.o_proj.'),
           ('.mlp.dense_h_to_4h.', '.mlp.c_fc.'), ('.mlp.dense_4h_to_h.', '.mlp.c_proj.'))


class FalconForCausalLM(LlamaForCausalLM):
    model_cls = FalconModel
    stacked_params = [('qkv_proj', 'q_proj', 'q'), ('qkv_proj', 'k_proj', 'k'), ('qkv_proj', 'v_proj', 'v')]

    def __init__(self, cfg: ModelConfig):
        alibi = ConfigFields(cfg.raw, 'config.json').flag('alibi', False)
        if alibi:
            self.attention_cls = ScaledAlibiAttention
        super().__init__(cfg)
        if alibi:
            drop_rotary(self)

    def checkpoint_names(self, weights: Iterable[Tuple[str, CheckpointTensor]]) -> Iterator[Tuple[str, object]]:
        """Falcon's tensors under this model's names, query_key_value unpacked into q_proj, k_proj, v_proj."""
        cfg = self.config
        new, _, _ = layout(cfg)
        d, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        for name, src in weights:
            if isinstance(src, torch.Tensor):
                src = CheckpointTensor(src)
            for old, renamed in RENAMES:
                name = name.replace(old, renamed)
            if '.self_attention.query_key_value.' in name:
                prefix, param = name.split('.self_attention.query_key_value.')
                if new or kv_heads == heads:  # per KV group: its query heads, k, v
                    parts = unpack_wqkv(src, heads, kv_heads, d, name)
                else:  # multi-query: every query head, then k, then v
                    parts = split_rows(src, {'q': heads * d, 'k': d, 'v': d}, name)
                for part, rows in parts.items():
                    yield f'{prefix}.self_attn.{part}_proj.{param}', rows
            else:
                yield name, src

    def load_weights(self, weights: Iterable[Tuple[str, CheckpointTensor]]):
        super().load_weights(self.checkpoint_names(weights))
