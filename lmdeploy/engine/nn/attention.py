"""Paged attention layer: rotates q and k (RoPE), writes the step's K/V into
the cache, then attends (within the layer's sliding window, scores soft-capped, where its model says)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .build import device_ops
from .context import StepContext


class PagedAttention(nn.Module):

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                 scale: Optional[float] = None):
        """``sliding_window``: a query sees its last W positions only; ``logit_softcap``: scores c tanh(s / c)
        (devices/interface.py); ``scale``: the scores' factor (default 1 / sqrt(head_dim))."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        # passed to the ops only when set, so that a device whose ops predate them still runs other models
        self.variant = {k: v for k, v in (('sliding_window', sliding_window), ('logit_softcap', logit_softcap))
                        if v is not None}
        self.ops = device_ops()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] before RoPE; cos/sin [T, D] -> [T, H*D]."""
        if ctx.pieces is not None:  # being recorded in pieces: attention runs live between them
            return ctx.pieces.attention(self, q, k, v, cos, sin)
        return self.attend(q, k, v, cos, sin, ctx)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               ctx: StepContext) -> torch.Tensor:
        ops, cache = self.ops, ctx.kv_caches[self.layer_idx]
        q, k = ops.rotary_fill_kv(q, k, v, cos, sin, cache, ctx.slot_mapping)
        if ctx.is_decode:
            out = ops.paged_decode_attention(q, cache, ctx.block_tables, ctx.kv_seqlens, self.scale, ctx.max_kv_len,
                                             ctx.decode_order, **self.variant)
        else:
            # the leading one-token rows as a decode batch, then the prompt rows (q_start_loc holds their rows in
            # q) over them: in a recorded step the decode batch is padded past the real one-token rows, and its
            # padding rows (no context: zeros) may be prompt rows, which the prefill then writes
            nd = ctx.num_decode
            out = torch.empty_like(q)
            if nd:
                ops.paged_decode_attention(q[:nd], cache, ctx.block_tables[:nd], ctx.kv_seqlens[:nd], self.scale,
                                           ctx.max_kv_len, ctx.decode_order, out=out[:nd], **self.variant)
            ops.paged_prefill_attention(q, cache, ctx.block_tables[nd:], ctx.q_start_loc[nd:],
                                        ctx.q_seqlens[nd:], ctx.kv_seqlens[nd:], self.scale, ctx.max_q_len,
                                        ctx.max_kv_len, out=out, **self.variant)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
