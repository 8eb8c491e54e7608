"""Linear layers whose parameters load straight from Hugging Face names.

Fused layers (q|k|v, gate|up) keep one weight and accept the separate
checkpoint tensors through ``load_param``. Under tensor parallelism
(nn/parallel.py) a :class:`MergedLinear` holds some rows of each checkpoint
tensor (column parallel) and a :class:`RowParallelLinear` some columns, its
partial outputs summed over the ranks.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Union

import torch
from torch import nn

from lmdeploy.devices.layers import param_layout

from .build import device_ops, layer_impl
from .loading import CheckpointTensor
from .parallel import tensor_parallel


class Linear(nn.Module):
    """y = x W^T + b, whole on every rank. Its parameters are the device's implementation's for the
    checkpoint's weight format (devices/layers.py: ``weight`` [out, in] for plain weights, an int8 weight
    and its scales, ...); each says which of its dims are output rows and input columns."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.ops = device_ops()
        self.impl = layer_impl('linear')
        self.impl.create_weights(self, in_features, out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl.apply(self, x)

    def process_weights(self):
        """Once, after loading (the implementation may repack its parameters)."""
        self.impl.process_weights(self)


class MergedLinear(Linear):
    """Several projections of one input stacked along the output dim; of each
    checkpoint tensor (shard) this rank holds the given rows."""

    def __init__(self, in_features: int, shards: Dict[str, Union[int, range]], bias: bool = False):
        rows = {name: r if isinstance(r, range) else range(r) for name, r in shards.items()}
        super().__init__(in_features, sum(len(r) for r in rows.values()), bias)
        self.checkpoint_rows = rows
        self.shard_offsets: Dict[str, slice] = {}
        start = 0
        for name, r in rows.items():
            self.shard_offsets[name] = slice(start, start + len(r))
            start += len(r)
        self.split_sizes: Sequence[int] = [len(r) for r in rows.values()]

    def load_param(self, param_name: str, shard: str, src: CheckpointTensor):
        param: Optional[torch.Tensor] = getattr(self, param_name)
        rows = self.checkpoint_rows[shard]
        if param_layout(self, param_name).output_dim != 0:
            raise ValueError(f'{param_name}: a stacked layer takes parameters split by output rows')
        if src.shape[0] < rows.stop:
            raise ValueError(f'shard {shard!r} has {src.shape[0]} rows, expected {rows.stop}')
        param.data[self.shard_offsets[shard]].copy_(src.take(rows))


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T, + b: the rank holds input features ``cols``
    (its x is the matching slice, e.g. its attention heads' outputs)."""

    def __init__(self, cols: range, out_features: int, bias: bool = False):
        super().__init__(len(cols), out_features, bias)
        self.cols = cols
        self.tp = tensor_parallel().size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return self.impl.apply(self, x)
        y = self.ops.all_reduce(self.impl.apply(self, x, with_bias=False))
        return y if self.bias is None else y + self.bias

    def load_param(self, param_name: str, shard: str, src: CheckpointTensor):
        param = getattr(self, param_name)
        # a parameter with input columns holds this rank's; the others (bias, per-row scales) whole
        if param_layout(self, param_name).input_dim == 1:
            param.data.copy_(src.take(cols=self.cols))
        else:
            param.data.copy_(src.take())
