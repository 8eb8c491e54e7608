"""Replays recorded steps on devices that can capture graphs.

Decode steps: a step of B sequences is padded to the next captured batch
size; inputs are copied into static buffers, the recorded graph replays,
and the first B rows of its static output are returned. Padding rows have
no context (kv_seqlen 0) and no cache slot (-1), so they write nothing.

Steps with prompt rows (mixed steps) are recorded per token count T (the
buckets of :func:`token_buckets`): the one-token rows as a decode
batch padded to D = min(T, max_batch_size) rows, then up to P prompt
sequences (:func:`mixed_prompt_slots`), padded with empty ones (q_seqlen 0).
Attention runs the padded decode batch first and the prompt sequences
after it, so a padding decode row that is really a prompt row is
overwritten by the prefill. The grids are fixed by (T, D, P); which
programs do work is read from the static buffers. Steps with more prompt
sequences than P, or more tokens than the largest bucket, run eagerly.
"""
from __future__ import annotations

import bisect
from typing import Callable, Dict, List, Tuple

import torch

from lmdeploy.devices.runtime import DeviceRuntime

from .nn import StepContext
from .plan import RankPlan


def capture_sizes(max_batch_size: int) -> List[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    sizes = sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})
    return sizes


def token_buckets(max_tokens: int) -> List[int]:
    """The token counts steps with prompt rows are recorded at: every 16 up to 512, every 32 to 1024, every 64
    beyond. A padding row costs as much GEMM work as a real one (on an H100,
    a 1,200-token step padded to 1,280 took 1.9 ms longer than unpadded)."""
    sizes = list(range(16, 513, 16)) + list(range(544, 1025, 32)) + list(range(1088, max_tokens + 64, 64))
    return [s for s in sizes if s < max_tokens] + [max_tokens]


def mixed_prompt_slots(num_tokens: int) -> int:
    """Prompt sequences a mixed step of ``num_tokens`` tokens is recorded with: a prompt row carries at
    least 2 tokens; beyond 64 the empty programs of the prefill grid start to cost (a step with more
    prompts runs eagerly)."""
    return max(1, min(64, num_tokens // 2))


class GraphRunner:

    def __init__(self, runtime: DeviceRuntime, forward: Callable, kv_caches, plan: RankPlan):
        """Records decode steps up to ``plan.max_batch_size`` sequences and, where ``plan.records_mixed_steps``,
        steps with prompt rows up to ``plan.max_mixed_tokens`` tokens (0: none)."""
        self.runtime = runtime  # what records and replays (capture_graph)
        self.forward = forward
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(plan.max_batch_size)
        self.max_batch_size = plan.max_batch_size
        max_mixed_tokens = plan.max_mixed_tokens if plan.records_mixed_steps else 0
        self.mixed_sizes = token_buckets(max_mixed_tokens) if max_mixed_tokens > 0 else []
        self.max_kv_len = plan.session_len
        max_blocks = plan.max_blocks
        torch_device = runtime.torch_device()
        tokens = max([self.sizes[-1]] + self.mixed_sizes)
        seqs = self.sizes[-1] + (mixed_prompt_slots(self.mixed_sizes[-1]) if self.mixed_sizes else 0)

        def buf(value, *shape, dtype=torch.int64):
            return torch.full(shape, value, dtype=dtype, device=torch_device)

        self.input_ids = buf(0, tokens)
        self.positions = buf(0, tokens)
        self.slots = buf(-1, tokens)
        self.rope_lens = buf(1, tokens)
        self.q_start = torch.arange(seqs, device=torch_device)
        self.q_lens = buf(1, seqs)
        self.kv_lens = buf(0, seqs)
        self.tables = buf(0, seqs, max_blocks, dtype=torch.int32)
        # int64, as an eager step's order: a kernel given another index type would be compiled again for
        # the eager steps' decode rows, mid-run (a cold-cache H100 run lost ~6 s that way)
        self.rows = torch.arange(self.sizes[-1], dtype=torch.int64, device=torch_device)
        self.order = self.rows.clone()
        self.graphs: Dict[Tuple[str, int], Tuple[Callable[[], None], torch.Tensor]] = {}
        self.pool = None  # one memory pool for this engine's graphs

    def capture_all(self):
        """Record every size now (largest first, so the pool is sized once),
        so no request pays for a capture."""
        for n in sorted(self.mixed_sizes, reverse=True):
            self._graph('mixed', n)
        for n in reversed(self.sizes):
            self._graph('decode', n)

    def mixed_limit(self) -> Tuple[int, int]:
        """(tokens, prompt sequences) of the largest recorded step with prompt rows."""
        return self.mixed_sizes[-1], mixed_prompt_slots(self.mixed_sizes[-1])

    # -------------------------------------------------------------- contexts
    def _decode_context(self, n: int) -> StepContext:
        return StepContext(is_decode=True, q_start_loc=self.q_start[:n], q_seqlens=self.q_lens[:n],
                           kv_seqlens=self.kv_lens[:n], block_tables=self.tables[:n], slot_mapping=self.slots[:n],
                           rope_lens=self.rope_lens[:n], max_q_len=1, max_kv_len=self.max_kv_len,
                           kv_caches=self.kv_caches, decode_order=self.order[:n])

    def _mixed_shape(self, t: int) -> Tuple[int, int, int]:
        """(tokens, decode rows, prompt slots) of the recording a step of t tokens uses."""
        n = self.mixed_sizes[bisect.bisect_left(self.mixed_sizes, t)]
        return n, min(n, self.max_batch_size), mixed_prompt_slots(n)

    def _mixed_context(self, n: int) -> StepContext:
        _, d, p = self._mixed_shape(n)
        return StepContext(is_decode=False, q_start_loc=self.q_start[:d + p], q_seqlens=self.q_lens[:d + p],
                           kv_seqlens=self.kv_lens[:d + p], block_tables=self.tables[:d + p],
                           slot_mapping=self.slots[:n], rope_lens=self.rope_lens[:n], max_q_len=n,
                           max_kv_len=self.max_kv_len, kv_caches=self.kv_caches, num_decode=d,
                           decode_order=self.order[:d])

    def _graph(self, kind: str, n: int):
        key = (kind, n)
        if key not in self.graphs:
            ctx = self._decode_context(n) if kind == 'decode' else self._mixed_context(n)
            if kind == 'mixed':  # a harmless recording input: no prompt rows, no context
                _, d, p = self._mixed_shape(n)
                self.q_lens[d:d + p].zero_()
                self.kv_lens[:d + p].zero_()
            replay, out, self.pool = self.runtime.capture_graph(
                lambda: self.forward(self.input_ids[:n], self.positions[:n], ctx), self.pool)
            self.graphs[key] = (replay, out)
        return self.graphs[key]

    # ---------------------------------------------------------------- replay
    def fits(self, input_ids: torch.Tensor, ctx: StepContext) -> bool:
        if ctx.block_tables.shape[1] > self.tables.shape[1]:
            return False
        if ctx.is_decode:
            return input_ids.shape[0] <= self.sizes[-1]
        t = input_ids.shape[0]
        if not self.mixed_sizes or t > self.mixed_sizes[-1]:
            return False
        return ctx.block_tables.shape[0] - ctx.num_decode <= self._mixed_shape(t)[2]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Replay the step (it must :meth:`fit`)."""
        return self._decode(input_ids, positions, ctx) if ctx.is_decode else self._mixed(input_ids, positions, ctx)

    def _decode(self, input_ids, positions, ctx: StepContext) -> torch.Tensor:
        b = input_ids.shape[0]
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
        replay, out = self._graph('decode', n)
        replay()
        return out[:b]

    def _mixed(self, input_ids, positions, ctx: StepContext) -> torch.Tensor:
        t = input_ids.shape[0]
        n, d, p = self._mixed_shape(t)
        nd, w = ctx.num_decode, ctx.block_tables.shape[1]
        num_prompts = ctx.block_tables.shape[0] - nd
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.rope_lens[:t].copy_(ctx.rope_lens)
        self.slots[:t].copy_(ctx.slot_mapping)
        self.slots[t:n].fill_(-1)  # padding tokens write no cache
        # the decode batch: real one-token rows, then empty ones
        self.kv_lens[:nd].copy_(ctx.kv_seqlens[:nd])
        self.kv_lens[nd:d].fill_(0)
        self.tables[:nd, :w].copy_(ctx.block_tables[:nd])
        self.order[:nd].copy_(ctx.decode_order if ctx.decode_order is not None else self.rows[:nd])
        self.order[nd:d].copy_(self.rows[nd:d])
        # the prompt sequences, then empty ones
        end = d + num_prompts
        self.q_start[d:end].copy_(ctx.q_start_loc[nd:])
        self.q_lens[d:end].copy_(ctx.q_seqlens[nd:])
        self.q_lens[end:d + p].fill_(0)
        self.kv_lens[d:end].copy_(ctx.kv_seqlens[nd:])
        self.tables[d:end, :w].copy_(ctx.block_tables[nd:])
        replay, out = self._graph('mixed', n)
        replay()
        return out[:t]
