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

from lmdeploy.devices.layers import ParamLayout, param_layout

from .build import device_ops, layer_impl
from .loading import CheckpointTensor
from .parallel import tensor_parallel


def _packed(name: str, r: range, pack: int, what: str) -> range:
    """``r`` (rows or columns of the layer) as elements of a parameter that packs ``pack`` of them in one."""
    if pack == 1:
        return r
    if r.start % pack or r.stop % pack:
        raise ValueError(f'{name}: {what} {r.start}..{r.stop} do not split a tensor holding {pack} of them per '
                         f'element (its weight format needs this rank\'s share to be a multiple of {pack}: another '
                         'tensor parallel size may fit)')
    return range(r.start // pack, r.stop // pack)


def _take(name: str, src: CheckpointTensor, dim: Optional[int], r: Optional[range]) -> torch.Tensor:
    """The checkpoint tensor's elements ``r`` along ``dim`` (whole: dim None)."""
    if dim is None:
        return src.take()
    if dim > 1:
        raise ValueError(f'{name}: a tensor split along dim {dim} (the loaders split dims 0 and 1)')
    if src.shape[dim] < r.stop:
        raise ValueError(f'{name}: checkpoint shape {src.shape} has {src.shape[dim]} along dim {dim}, expected at '
                         f'least {r.stop}')
    return src.take(rows=r) if dim == 0 else src.take(cols=r)


def _copy(name: str, param: torch.Tensor, value: torch.Tensor):
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f'{name}: the checkpoint gives {tuple(value.shape)} where this rank\'s layer holds '
                         f'{tuple(param.shape)} (a tensor its weight format keeps whole on every rank, e.g. '
                         'GPTQ\'s desc_act scales, does not split across ranks yet)')
    param.copy_(value)


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
        """This rank's output rows of the shard's tensor, at the shard's place along the parameter's output
        dim (in elements of its layout: 8 rows per element of an int4-packed tensor, ...). A parameter without
        output rows (GPTQ's g_idx) is the same for every shard: the first loads it, the others must agree."""
        param: Optional[torch.Tensor] = getattr(self, param_name)
        layout: ParamLayout = param_layout(self, param_name)
        name = f'{param_name}[{shard}]'
        d, pack = layout.output_dim, layout.output_pack
        if d is None:
            value = src.take()
            loaded = self.__dict__.setdefault('_whole_loaded', set())
            if param_name in loaded and not torch.equal(param.data, value.to(param.device, param.dtype)):
                raise ValueError(f'{name}: differs between the projections stacked in one layer')
            loaded.add(param_name)
            _copy(name, param.data, value)
            return
        off = self.shard_offsets[shard]
        rows = _packed(name, self.checkpoint_rows[shard], pack, 'output rows')
        at = _packed(name, range(off.start, off.stop), pack, 'output rows')
        _copy(name, param.data.narrow(d, at.start, len(at)), _take(name, src, d, rows))


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
        # a parameter with input columns holds this rank's (in elements of its layout: 8 columns per element
        # of an int4-packed tensor, a group's per group scale); the others (bias, per-row scales) whole
        layout = param_layout(self, param_name)
        cols = None if layout.input_dim is None else _packed(param_name, self.cols, layout.input_pack, 'input columns')
        _copy(param_name, param.data, _take(param_name, src, layout.input_dim, cols))
