"""Linear layers whose parameters load straight from Hugging Face names.

Fused layers (q|k|v, gate|up) keep one weight and accept the separate
checkpoint tensors through ``load_shard``.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torch import nn

from lmdeploy.devices import ops


class Linear(nn.Module):

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input stacked along the output dim."""

    def __init__(self, in_features: int, shard_sizes: Dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: Dict[str, slice] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = slice(start, start + size)
            start += size
        self.split_sizes: Sequence[int] = list(shard_sizes.values())

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor):
        param: Optional[torch.Tensor] = getattr(self, param_name)
        rows = self.shard_offsets[shard]
        if tensor.shape[0] != rows.stop - rows.start:
            raise ValueError(f'shard {shard!r} has {tensor.shape[0]} rows, expected {rows.stop - rows.start}')
        param.data[rows].copy_(tensor)
