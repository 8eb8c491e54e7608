"""Steps with prompt rows, replayed in pieces: the model's dense work from
recorded graphs, attention run live between them.

A decode step has one shape per batch size, so it is recorded whole
(graph_runner.py). A step that prefills mixes prompt chunks of any length
with one-token rows, and its attention depends on all of them; everything
else (embedding, norms, projections, MLPs) depends only on the number of
tokens. So for each token-count bucket the model's forward is recorded as
a chain of graphs cut at every attention layer: piece 0 runs up to the
first layer's q/k/v, piece i from layer i-1's attention output to layer i's
q/k/v, the last to the final norm. At replay the step's tokens are padded
to the bucket, and each piece replays, then that layer's attention runs
live on the real rows (rotary, KV write, prefill and decode attention, with
the step's own metadata) and its output is copied where the next piece
reads it. Host work per step: one replay per layer plus attention's few
launches, instead of every kernel of every layer.

Padding rows carry token 0 at position 0 through the dense pieces only; no
attention or cache write sees them, and rows are independent in every
dense op, so the real rows are exact.
"""
from __future__ import annotations

import bisect
from typing import Callable, Dict, List, Optional

import torch

from lmdeploy.devices.runtime import DeviceRuntime

from .graph_runner import token_buckets
from .nn import StepContext
from .plan import RankPlan


class _Recording:
    """One bucket's pieces, and what the live attention between them needs."""

    def __init__(self):
        self.replays: List[Callable[[], None]] = []
        self.layers: List[torch.nn.Module] = []  # the attention module after piece i
        self.cos: Optional[torch.Tensor] = None  # made by piece 0 (static), read by every layer's attention
        self.sin: Optional[torch.Tensor] = None
        self.out: Optional[torch.Tensor] = None  # the last piece's output (hidden states)
        self.cut: Callable[[], None] = lambda: None


class PiecewiseRunner:

    def __init__(self, runtime: DeviceRuntime, model: torch.nn.Module, kv_caches, plan: RankPlan):
        """Records steps of up to ``plan.max_mixed_tokens`` tokens."""
        self.runtime = runtime  # what records the pieces (capture_pieces)
        self.model = model
        self.kv_caches = kv_caches
        torch_device = runtime.torch_device()
        max_tokens = plan.max_mixed_tokens
        self.sizes = token_buckets(max_tokens)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=torch_device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=torch_device)
        self.rope_lens = torch.ones(n, dtype=torch.int64, device=torch_device)
        self.qkv: Optional[torch.Tensor] = None  # [n, H + 2 Hkv, D]: a piece's q, k, v for the live attention
        self.attn_out: Optional[torch.Tensor] = None  # [n, H * D]: the live attention's output, read by a piece
        self.heads = (0, 0)
        self.recordings: Dict[int, _Recording] = {}
        self.pool = None
        self._recording: Optional[_Recording] = None

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def capture_all(self):
        """Record every bucket now, largest first (the pool is sized once)."""
        for n in reversed(self.sizes):
            self._record(n)

    # ------------------------------------------------------------ recording
    def attention(self, layer: torch.nn.Module, q, k, v, cos, sin) -> torch.Tensor:
        """Called by each attention layer while a bucket is recorded (``StepContext.pieces``):
        stash q/k/v where the live attention will read them, end the piece, start the next."""
        rec = self._recording
        t = q.shape[0]
        if self.qkv is None:
            h, hkv, d = q.shape[1], k.shape[1], q.shape[2]
            self.heads = (h, hkv)
            self.qkv = torch.zeros((self.sizes[-1], h + 2 * hkv, d), dtype=q.dtype, device=q.device)
            self.attn_out = torch.zeros((self.sizes[-1], h * d), dtype=q.dtype, device=q.device)
        torch.cat([q, k, v], dim=1, out=self.qkv[:t])
        rec.cos, rec.sin = cos, sin
        rec.layers.append(layer)
        rec.cut()
        return self.attn_out[:t]

    def _record(self, n: int):
        rec = self._recording = _Recording()
        empty = self.input_ids[:0]
        ctx = StepContext(is_decode=False, q_start_loc=empty, q_seqlens=empty, kv_seqlens=empty,
                          block_tables=empty.view(0, 0).int(), slot_mapping=empty, rope_lens=self.rope_lens[:n],
                          max_q_len=0, max_kv_len=0, kv_caches=self.kv_caches, pieces=self)

        def forward(cut):
            rec.layers.clear()
            rec.cut = cut
            return self.model(self.input_ids[:n], self.positions[:n], ctx)

        rec.replays, rec.out, self.pool = self.runtime.capture_pieces(forward, self.pool)
        assert len(rec.replays) == len(rec.layers) + 1
        self.recordings[n] = rec
        self._recording = None

    # --------------------------------------------------------------- replay
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = input_ids.shape[0]
        n = self.sizes[bisect.bisect_left(self.sizes, t)]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.rope_lens[:t].copy_(ctx.rope_lens)
        if t < n:
            self.input_ids[t:n].zero_()
            self.positions[t:n].zero_()
            self.rope_lens[t:n].fill_(1)
        rec = self.recordings[n]
        h, hkv = self.heads
        q, k, v = self.qkv[:t, :h], self.qkv[:t, h:h + hkv], self.qkv[:t, h + hkv:]
        cos, sin = rec.cos[:t], rec.sin[:t]
        out = self.attn_out[:t]
        for replay, layer in zip(rec.replays, rec.layers):
            replay()
            out.copy_(layer.attend(q, k, v, cos, sin, ctx))
        rec.replays[-1]()
        return rec.out[:t]
