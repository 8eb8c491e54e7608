"""Rank 0's runner under tensor parallelism: before each step (and each
logits call) it sends the other ranks what to run (channel.py), then runs its
own shard; the collectives inside the model line up because every rank runs
the same calls in the same order. Sampling happens here only."""
from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np
import torch

from ..model_runner import ModelRunner
from ..scheduler import ScheduledBatch
from ..transfer import int64_tensor, to_device
from . import channel


class RankLost(RuntimeError):
    """A tensor-parallel rank is gone: no step can run any more."""


class ParallelRunner:

    def __init__(self, runner: ModelRunner, workers):
        self.runner = runner
        self.workers = workers
        self.commands = workers.commands
        self.plan = runner.plan
        self.kv_caches = runner.kv_caches
        self.recorded_step_limit = runner.recorded_step_limit

    def _check(self):
        why = self.workers.error()
        if why:
            raise RankLost(f'tensor parallelism lost a rank: {why}; the engine cannot run steps any more')

    def _explain(self, e: Exception):
        """After a failed step or logits call. A collective that failed because a rank died says so (the
        backend's own message names only a socket; the rank's exit may take a moment to show). Any other
        failure leaves the ranks out of step (some wait in a collective this rank never reaches): they are
        stopped, and no step runs any more."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            self._check()
            time.sleep(0.05)
        self.workers.fail(f'rank 0 failed a step ({type(e).__name__}: {e}), which leaves the ranks out of step')

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, prev_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._check()
        try:
            return self._forward(batch, prev_tokens)
        except RankLost:
            raise
        except Exception as e:
            self._explain(e)
            raise

    def _forward(self, batch: ScheduledBatch, prev_tokens: Optional[torch.Tensor]) -> torch.Tensor:
        r = self.runner
        flat, meta = r.pack_inputs(batch, prev_tokens is not None)
        host = int64_tensor(flat)
        self.commands.send(channel.FORWARD, meta, host.numpy())  # first: the others start on it now
        ids, positions, ctx = r.unpack_inputs(to_device(host, r.torch_device), meta, prev_tokens)
        if meta.n_prev:  # the tokens sampled by the step in flight are on this device only: the others get them
            ids = r.runtime.broadcast(ids.to(torch.int64).contiguous())
        return r.run(ids, positions, ctx)

    def rows(self, hidden: torch.Tensor, rows):
        return self.runner.rows(hidden, rows)

    def logits(self, hidden: torch.Tensor, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        return self._on_rows(channel.LOGITS, self.runner.logits, hidden, rows)

    def greedy(self, hidden: torch.Tensor, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        return self._on_rows(channel.GREEDY, self.runner.greedy, hidden, rows)

    @torch.inference_mode()
    def _on_rows(self, cmd: int, fn, hidden: torch.Tensor, rows: Optional[Sequence[int]]) -> torch.Tensor:
        """``fn(hidden)`` here, with the other ranks told to run it on the same rows of the step's hidden states
        (``rows``; all when None)."""
        self._check()
        rows = range(hidden.shape[0]) if rows is None else rows
        try:
            self.commands.send(cmd, (), np.fromiter(rows, dtype=np.int64))
            return fn(hidden)
        except Exception as e:
            self._explain(e)
            raise

    def stop(self):
        """Wait until this rank's queued work is done (the group must not be torn down under a collective),
        then tell the other ranks to exit (when none is gone)."""
        if self.workers.error() is None:
            # (a read-back on the rank's own device: this may run on a thread whose current device is another)
            torch.zeros(1, device=self.runner.torch_device).tolist()
            self.commands.send(channel.STOP)
        self.runner.drop_recordings()
