"""InternLM2 / InternLM2.5: Llama's computation under other names, with q, k and v packed in one tensor.

    checkpoint                         here (Llama's)
    model.tok_embeddings               model.embed_tokens
    attention.wqkv                     self_attn.qkv_proj (q, k, v unpacked, below)
    attention.wo                       self_attn.o_proj
    attention_norm, ffn_norm           input_layernorm, post_attention_layernorm
    feed_forward.w1, w3, w2            mlp's gate, up, down
    output                             lm_head

``wqkv`` holds, for each KV head in turn, its G = heads / kv_heads query heads, then its k head, then
its v head, head_dim rows each: rows [kv_heads, G + 2, head_dim] (InternLM's tools/convert2llama.py
splits it so). config.json's ``bias`` puts biases on wqkv and wo (Llama's ``attention_bias``); the MLP has
none; head_dim is hidden_size / heads.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch

from ..model_config import ConfigFields, ModelConfig
from ..nn.loading import CheckpointTensor
from .llama import LlamaForCausalLM


class GroupedRows:
    """One of q, k, v of a packed wqkv, as a checkpoint tensor of its own.

    Row r of the part is row ``(r // block) * stride + offset + r % block`` of the packed tensor (``block``
    rows of it in each KV group of ``stride`` rows). ``take`` reads only the packed rows asked for (a
    tensor-parallel rank's heads), one contiguous read per KV group they touch."""

    def __init__(self, packed: CheckpointTensor, block: int, offset: int, stride: int):
        self.packed, self.block, self.offset, self.stride = packed, block, offset, stride
        self.rows = packed.shape[0] // stride * block

    @property
    def shape(self):
        return (self.rows, *self.packed.shape[1:])

    def take(self, rows: Optional[range] = None, cols: Optional[range] = None) -> torch.Tensor:
        rows = range(self.rows) if rows is None else rows
        if not 0 <= rows.start <= rows.stop <= self.rows:
            raise ValueError(f'rows {rows} are outside the {self.rows} rows of this part of wqkv')
        pieces, start = [], rows.start
        while start < rows.stop:
            group = start // self.block
            stop = min(rows.stop, (group + 1) * self.block)
            at = group * self.stride + self.offset - group * self.block
            pieces.append(self.packed.take(range(at + start, at + stop), cols))
            start = stop
        if not pieces:
            return self.packed.take(range(0, 0), cols)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def unpack_wqkv(packed: CheckpointTensor, num_heads: int, num_kv_heads: int, head_dim: int,
                name: str = 'wqkv') -> Dict[str, GroupedRows]:
    """q, k and v of an InternLM2 ``wqkv`` weight or bias (or any parameter split by output rows), unread."""
    group = num_heads // num_kv_heads
    stride = (group + 2) * head_dim
    if packed.shape[0] != num_kv_heads * stride:
        raise ValueError(f'{name}: {packed.shape[0]} rows, expected {num_kv_heads} KV groups of {group} query '
                         f'heads + k + v of {head_dim} rows = {num_kv_heads * stride}')
    return {
        'q': GroupedRows(packed, group * head_dim, 0, stride),
        'k': GroupedRows(packed, head_dim, group * head_dim, stride),
        'v': GroupedRows(packed, head_dim, (group + 1) * head_dim, stride),
    }


# checkpoint name part -> Llama's
RENAMES = (('model.tok_embeddings.', 'model.embed_tokens.'), ('.attention.wo.', '.self_attn.o_proj.'),
           ('.attention_norm.', '.input_layernorm.'), ('.ffn_norm.', '.post_attention_layernorm.'),
           ('.feed_forward.w1.', '.mlp.gate_proj.'), ('.feed_forward.w3.', '.mlp.up_proj.'),
           ('.feed_forward.w2.', '.mlp.down_proj.'))


class InternLM2ForCausalLM(LlamaForCausalLM):

    def __init__(self, cfg: ModelConfig):
        bias = ConfigFields(cfg.raw, 'config.json').flag('bias', False)
        super().__init__(dataclasses.replace(cfg, attention_bias=bias, mlp_bias=False))

    def checkpoint_names(self, weights: Iterable[Tuple[str, CheckpointTensor]]) -> Iterator[Tuple[str, object]]:
        """InternLM2's tensors as Llama's: renamed, wqkv unpacked into q_proj, k_proj and v_proj."""
        cfg = self.config
        for name, src in weights:
            if isinstance(src, torch.Tensor):
                src = CheckpointTensor(src)
            if '.attention.wqkv.' in name:
                prefix, param = name.split('.attention.wqkv.')
                for part, rows in unpack_wqkv(src, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, name).items():
                    yield f'{prefix}.self_attn.{part}_proj.{param}', rows
                continue
            for old, new in RENAMES:
                name = name.replace(old, new)
            if name.startswith('output.'):
                name = 'lm_head.' + name[len('output.'):]
            yield name, src

    def load_weights(self, weights: Iterable[Tuple[str, CheckpointTensor]]):
        super().load_weights(self.checkpoint_names(weights))
