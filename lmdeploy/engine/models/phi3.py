"""Phi-3 / Phi-3.5-mini / Phi-4 (``Phi3ForCausalLM``): Llama's computation with fused checkpoint tensors.

    checkpoint                         here (Llama's)
    self_attn.qkv_proj                 q rows (heads * head_dim), then k, then v (kv_heads * head_dim each)
    mlp.gate_up_proj                   gate rows (intermediate_size), then up rows

Each is unpacked on load into views of its rows (internlm2.GroupedRows with one block), so a
tensor-parallel rank reads only its own rows of the fused tensor. The MLP is up * silu(gate) (transformers'
Phi3MLP), Llama's. Long-context checkpoints use LongRoPE (``rope_scaling.type`` 'longrope', older 'su'),
read by model_config.py and applied by nn/rotary.py. Every layer attends within ``sliding_window`` (as
transformers' Phi3 does: 2047 in Phi-3-mini-4k).

``partial_rotary_factor`` < 1 (Phi-4-mini: rotary on the first 3/4 of each head, pairs i, i + r/2): the ops
rotate whole heads (pairs j, j + head_dim/2), so the rows of each q and k head are reordered on load
(nn/rotary.partial_rotary_order) to put the rotated pairs there and the other dims where the rotary
embedding gives cos 1, sin 0. q and k reordered alike leave every q.k, so the attention, unchanged.
"""
from __future__ import annotations

import dataclasses

from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch

from ..model_config import ModelConfig
from ..nn.loading import CheckpointTensor
from ..nn.rotary import RotaryEmbedding, partial_rotary_order, rotary_partial_dim
from .internlm2 import GroupedRows
from .llama import LlamaAttention, LlamaForCausalLM


def split_rows(packed: CheckpointTensor, sizes: Dict[str, int], name: str) -> Dict[str, GroupedRows]:
    """Consecutive row blocks of a fused tensor (weight or bias), as unread checkpoint tensors."""
    total = sum(sizes.values())
    if packed.shape[0] != total:
        parts = ' + '.join(f'{part} {n}' for part, n in sizes.items())
        raise ValueError(f'{name}: {packed.shape[0]} rows, expected {parts} = {total}')
    views, at = {}, 0
    for part, n in sizes.items():
        views[part] = GroupedRows(packed, n, at, total)
        at += n
    return views


class HeadPermuted:
    """A q or k part whose rows are reordered within each head: row j of a head is its row ``order[j]``.
    Reads only the heads asked for."""

    def __init__(self, part, head_dim: int, order):
        self.part, self.head_dim, self.order = part, head_dim, torch.tensor(order)

    @property
    def shape(self):
        return self.part.shape

    def take(self, rows: Optional[range] = None, cols: Optional[range] = None) -> torch.Tensor:
        d = self.head_dim
        if rows is not None and (rows.start % d or rows.stop % d):
            raise ValueError(f'rows {rows} are not whole heads of {d} rows')
        t = self.part.take(rows, cols)
        return t.reshape(t.shape[0] // d, d, *t.shape[1:])[:, self.order].reshape(t.shape)


class Phi3Attention(LlamaAttention):
    window_rule = 'all'


class Phi3ForCausalLM(LlamaForCausalLM):
    attention_cls = Phi3Attention

    def __init__(self, cfg: ModelConfig):
        # Llama's rotary embedding (replaced below) refuses partial rotary; this model lays q and k out for it
        plain = dataclasses.replace(cfg.rope, type='default', partial_rotary_factor=1.0)
        super().__init__(dataclasses.replace(cfg, rope=plain))
        self.config = cfg
        self.rotary_dim = rotary_partial_dim(cfg.head_dim, cfg.rope)
        self.model.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings,
                                                partial_layout=True)

    def checkpoint_names(self, weights: Iterable[Tuple[str, CheckpointTensor]]) -> Iterator[Tuple[str, object]]:
        """Phi-3's tensors as Llama's: qkv_proj into q_proj, k_proj, v_proj; gate_up_proj into gate_proj,
        up_proj."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {'.self_attn.qkv_proj.': ('.self_attn.', {'q': q, 'k': kv, 'v': kv}),
                 '.mlp.gate_up_proj.': ('.mlp.', {'gate': cfg.intermediate_size, 'up': cfg.intermediate_size})}
        for name, src in weights:
            if isinstance(src, torch.Tensor):
                src = CheckpointTensor(src)
            for marker, (owner, sizes) in fused.items():
                if marker in name:
                    prefix, param = name.split(marker)
                    for part, rows in split_rows(src, sizes, name).items():
                        if part in ('q', 'k') and self.rotary_dim != cfg.head_dim:
                            rows = HeadPermuted(rows, cfg.head_dim, partial_rotary_order(cfg.head_dim,
                                                                                        self.rotary_dim))
                        yield f'{prefix}{owner}{part}_proj.{param}', rows
                    break
            else:
                yield name, src

    def load_weights(self, weights: Iterable[Tuple[str, CheckpointTensor]]):
        super().load_weights(self.checkpoint_names(weights))
