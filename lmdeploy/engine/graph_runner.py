"""Replays recorded decode steps on devices that can capture graphs.

A decode step of B sequences is padded to the next captured batch size;
inputs are copied into static buffers, the recorded graph replays, and the
first B rows of its static output are returned. Padding rows have no
context (kv_seqlen 0) and no cache slot (-1), so they write nothing. Steps
that prefill, or that are larger than the largest captured size, run eagerly.
"""
from __future__ import annotations

import bisect
from typing import Callable, Dict, List, Tuple

import torch

from lmdeploy.devices.interface import DeviceOps

from .nn import StepContext


def capture_sizes(max_batch_size: int) -> List[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    sizes = sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})
    return sizes


class GraphRunner:

    def __init__(self, device: DeviceOps, forward: Callable, kv_caches, max_batch_size: int, max_blocks: int,
                 max_kv_len: int, torch_device: torch.device):
        self.device = device
        self.forward = forward
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_batch_size)
        self.max_kv_len = max_kv_len
        n = self.sizes[-1]

        def buf(value, *shape, dtype=torch.int64):
            return torch.full(shape, value, dtype=dtype, device=torch_device)

        self.input_ids = buf(0, n)
        self.positions = buf(0, n)
        self.q_start = torch.arange(n, device=torch_device)
        self.q_lens = buf(1, n)
        self.kv_lens = buf(0, n)
        self.tables = buf(0, n, max_blocks, dtype=torch.int32)
        self.slots = buf(-1, n)
        self.rope_lens = buf(1, n)
        # int64, as an eager step's order: a kernel given another index type would be compiled again for
        # the eager steps' decode rows, mid-run (a cold-cache H100 run lost ~6 s that way)
        self.rows = torch.arange(n, dtype=torch.int64, device=torch_device)
        self.order = self.rows.clone()
        self.graphs: Dict[int, Tuple[Callable[[], None], torch.Tensor]] = {}
        self.pool = None  # one memory pool for this engine's graphs

    def capture_all(self):
        """Record every batch size now (largest first, so the pool is sized
        once), so no request pays for a capture."""
        for n in reversed(self.sizes):
            self._graph(n)

    def _context(self, n: int) -> StepContext:
        return StepContext(is_decode=True, q_start_loc=self.q_start[:n], q_seqlens=self.q_lens[:n],
                           kv_seqlens=self.kv_lens[:n], block_tables=self.tables[:n], slot_mapping=self.slots[:n],
                           rope_lens=self.rope_lens[:n], max_q_len=1, max_kv_len=self.max_kv_len,
                           kv_caches=self.kv_caches, decode_order=self.order[:n])

    def _graph(self, n: int):
        if n not in self.graphs:
            ctx = self._context(n)
            replay, out, self.pool = self.device.capture_graph(
                lambda: self.forward(self.input_ids[:n], self.positions[:n], ctx), self.pool)
            self.graphs[n] = (replay, out)
        return self.graphs[n]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        b = input_ids.shape[0]
        if not ctx.is_decode or b > self.sizes[-1] or ctx.block_tables.shape[1] > self.tables.shape[1]:
            return self.forward(input_ids, positions, ctx)
        n = self.sizes[bisect.bisect_left(self.sizes, b)]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.kv_lens[:b].copy_(ctx.kv_seqlens)
        self.kv_lens[b:n].fill_(0)
        self.slots[:b].copy_(ctx.slot_mapping)
        self.slots[b:n].fill_(-1)
        self.rope_lens[:b].copy_(ctx.rope_lens)
        self.order[:b].copy_(ctx.decode_order if ctx.decode_order is not None else self.rows[:b])
        self.order[b:n].copy_(self.rows[b:n])  # padding rows (no context) last
        self.tables[:b, :ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        replay, out = self._graph(n)
        replay()
        return out[:b]
