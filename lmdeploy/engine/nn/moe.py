"""A mixture of experts' feed-forward networks, loaded from per-expert checkpoint tensors.

The experts' weights belong to the device's ``experts`` layer implementation
(devices/layers.py: stacked ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] in
the reference's dense format); this block maps the checkpoint's tensors of
expert e (``gate``, ``up``, ``down``: Mixtral's w1 / w3 / w2, Qwen-MoE's
gate_proj / up_proj / down_proj) into them. Under tensor parallelism each
rank holds a slice of every expert's intermediate rows (gate and up rows,
down columns) and the ranks' outputs are summed, as in the dense MLP.
"""
from __future__ import annotations

import torch
from torch import nn

from .build import device_ops, layer_impl
from .loading import CheckpointTensor
from .parallel import split_range, tensor_parallel


class MoEExperts(nn.Module):
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) over each token's routed experts e = ids_k."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        tp = tensor_parallel()
        self.tp, self.inter = tp.size, inter
        self.rows = split_range(inter, tp.rank, tp.size)  # this rank's intermediate rows of every expert
        self.ops = device_ops()
        self.impl = layer_impl('experts')
        self.impl.create_weights(self, num_experts, hidden, len(self.rows))

    def load_param(self, param_name: str, shard, src: CheckpointTensor):
        """``shard``: (expert index, 'gate' | 'up' | 'down'); ``src`` that expert's [I, H] or [H, I] tensor."""
        expert, part = shard
        n = len(self.rows)
        if part == 'down':
            if src.shape[1] != self.inter:
                raise ValueError(f'{param_name}: expert {expert} down has {src.shape[1]} columns, expected '
                                 f'{self.inter}')
            self.down.data[expert].copy_(src.take(cols=self.rows))
            return
        if part not in ('gate', 'up'):
            raise ValueError(f'{param_name}: unknown expert projection {part!r}')
        if src.shape[0] != self.inter:
            raise ValueError(f'{param_name}: expert {expert} {part} has {src.shape[0]} rows, expected {self.inter}')
        at = slice(0, n) if part == 'gate' else slice(n, 2 * n)
        self.gate_up.data[expert, at].copy_(src.take(self.rows))

    def process_weights(self):
        self.impl.process_weights(self)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = self.impl.apply(self, x, topk_weights, topk_ids)
        return out if self.tp == 1 else self.ops.all_reduce(out)
