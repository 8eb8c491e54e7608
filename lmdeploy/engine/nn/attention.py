"""Paged attention layer: what the model's attention is (heads, scale, sliding window, soft cap, ALiBi slopes
instead of rotary); the device's attention implementation (devices/layers.py) rotates q and k, writes the step's
K/V into the cache and attends."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from torch import nn

from .build import layer_impl
from .context import StepContext


class PagedAttention(nn.Module):

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                 scale: Optional[float] = None, alibi_slopes: Optional[Sequence[float]] = None):
        """``sliding_window``: a query sees its last W positions only; ``logit_softcap``: scores c tanh(s / c)
        (devices/interface.py); ``scale``: the scores' factor (default 1 / sqrt(head_dim)); ``alibi_slopes``:
        this layer's heads' ALiBi slopes (scores + slope (j - p)), for a model that rotates nothing (its
        forward passes no cos / sin)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        # passed to the ops only when set, so that a device whose ops predate them still runs other models
        self.variant = {k: v for k, v in (('sliding_window', sliding_window), ('logit_softcap', logit_softcap))
                        if v is not None}
        self.impl = layer_impl('attention', dense=True)  # the device's (devices/layers.py)
        self.impl.create_weights(self)
        # (a plain list: the model is built on the meta device, where a buffer's values would not survive)
        self.alibi = None if alibi_slopes is None else [float(m) for m in alibi_slopes]
        self._alibi_on = None  # {'alibi_slopes': the slopes on the step's device}, made at the first (eager) step

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] before RoPE; cos/sin [T, D] -> [T, H*D]."""
        if ctx.pieces is not None:  # being recorded in pieces: attention runs live between them
            return ctx.pieces.attention(self, q, k, v, cos, sin)
        return self.attend(q, k, v, cos, sin, ctx)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               ctx: StepContext) -> torch.Tensor:
        variant = self.variant
        if self.alibi is not None:
            if self._alibi_on is None:
                slopes = torch.tensor(self.alibi, dtype=torch.float32, device=q.device)
                self._alibi_on = dict(self.variant, alibi_slopes=slopes)
            variant = self._alibi_on
        out = self.impl.apply(self, q, k, v, cos, sin, ctx, ctx.kv_caches[self.layer_idx], variant)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)


def alibi_slopes(num_heads: int) -> List[float]:
    """ALiBi's head slopes (Press et al.): for n a power of two the geometric sequence 2^(-8 i / n), i = 1..n;
    otherwise those of the largest power of two below n, then every other slope of twice that many (as
    BLOOM, Falcon-RW and Baichuan-13B make them)."""
    def powers_of_two(n: int) -> List[float]:
        return [2.0**(-8.0 * i / n) for i in range(1, n + 1)]

    closest = 2**int(math.floor(math.log2(num_heads)))
    return powers_of_two(closest) + powers_of_two(2 * closest)[0::2][:num_heads - closest]
