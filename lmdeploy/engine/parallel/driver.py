"""Rank 0's runner under tensor parallelism: before each step (and each
logits call) it broadcasts what to run, then runs its own shard; the
collectives inside the model line up because every rank runs the same calls
in the same order. Sampling happens here only."""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from ..model_runner import ModelRunner
from ..scheduler import ScheduledBatch
from ..transfer import int64_tensor, tensor_on, to_device
from . import channel


class RankLost(RuntimeError):
    """A tensor-parallel rank is gone: no step can run any more."""


class ParallelRunner:

    def __init__(self, runner: ModelRunner, workers):
        self.runner = runner
        self.workers = workers
        self.channel = channel.Channel(runner.runtime)
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
        dev = to_device(int64_tensor(flat), r.torch_device)
        ids, positions, ctx = r.unpack_inputs(dev, meta, prev_tokens)
        # the others get the inputs with the input ids resolved (the tokens in flight are only here)
        self.channel.send(channel.FORWARD, meta, torch.cat([dev, ids.to(torch.int64)]))
        return r.run(ids, positions, ctx)

    def rows(self, hidden: torch.Tensor, rows):
        return self.runner.rows(hidden, rows)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        self._check()
        rows = range(hidden.shape[0]) if rows is None else rows
        try:
            self.channel.send(channel.LOGITS, (), tensor_on(list(rows), self.runner.torch_device, torch.int64))
            return self.runner.logits(hidden)
        except Exception as e:
            self._explain(e)

    def stop(self):
        """Tell the other ranks to exit (when none is gone), and wait until the command has left this rank (a
        collective is only queued on the device: the group must not be torn down under it)."""
        if self.workers.error() is None:
            # (read back on its own device: this may run on a thread whose current device is another)
            self.channel.send(channel.STOP).tolist()
        self.runner.drop_recordings()
