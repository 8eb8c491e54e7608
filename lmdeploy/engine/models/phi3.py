"""Phi-3 / Phi-3.5-mini / Phi-4 (``Phi3ForCausalLM``): Llama's computation with fused checkpoint tensors.

    checkpoint                         here (Llama's)
    self_attn.qkv_proj                 q rows (heads * head_dim), then k, then v (kv_heads * head_dim each)
    mlp.gate_up_proj                   gate rows (intermediate_size), then up rows

Each is unpacked on load into views of its rows (internlm2.GroupedRows with one block), so a
tensor-parallel rank reads only its own rows of the fused tensor. The MLP is up * silu(gate) (transformers'
Phi3MLP), Llama's. Long-context checkpoints use LongRoPE (``rope_scaling.type`` 'longrope', older 'su'),
read by model_config.py and applied by nn/rotary.py. ``sliding_window`` is handled as for every model
(model_config.py caps the session length at it). ``partial_rotary_factor`` < 1 (Phi-4-mini) is refused
by model_config.py.
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator, Tuple

import torch

from ..nn.loading import CheckpointTensor
from .internlm2 import GroupedRows
from .llama import LlamaForCausalLM


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


class Phi3ForCausalLM(LlamaForCausalLM):

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
                        yield f'{prefix}{owner}{part}_proj.{param}', rows
                    break
            else:
                yield name, src

    def load_weights(self, weights: Iterable[Tuple[str, CheckpointTensor]]):
        super().load_weights(self.checkpoint_names(weights))
