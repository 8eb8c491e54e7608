"""A checkpoint tensor read only as far as a rank needs it.

Under tensor parallelism each rank holds a slice of most weights; reading the
slice straight from the safetensors file (``get_slice``) keeps the whole
tensor out of every process's memory.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class CheckpointTensor:
    """``data``: a torch tensor or a safetensors slice (both index like tensors)."""

    def __init__(self, data: Any, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None):
        self._data = data
        self._dtype = dtype
        self._device = device

    @property
    def shape(self):
        data = self._data
        return tuple(data.shape) if isinstance(data, torch.Tensor) else tuple(data.get_shape())

    def take(self, rows: Optional[range] = None, cols: Optional[range] = None) -> torch.Tensor:
        """The whole tensor, or its ``rows`` (dim 0) and/or ``cols`` (dim 1), converted for the model."""
        data = self._data
        if rows is None and cols is None:
            t = data if isinstance(data, torch.Tensor) else data[:]
        elif cols is None:
            t = data[rows.start:rows.stop]
        else:
            r = slice(None) if rows is None else slice(rows.start, rows.stop)
            t = data[r, cols.start:cols.stop]
        if self._dtype is not None and t.is_floating_point():
            t = t.to(self._dtype)
        return t if self._device is None else t.to(self._device)
