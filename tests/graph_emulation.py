"""A faithful stand-in for CUDA graphs on the CPU, for the engine's replay paths.

A recording keeps every aten op that ran (through a TorchDispatchMode) with
the very tensors it read and wrote; a replay runs the same ops again on
those tensors and writes each result into the tensor the recording made,
which is what a graph replay promises: the same work on the same memory,
reading whatever the static inputs hold now. Work done outside a recording
(the live attention between pieces) is not replayed.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmdeploy.devices.cpu import CpuOps


def _tensors(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


class Tape(TorchDispatchMode):

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out

    def replay(self):
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for old, fresh in zip(_tensors(out), _tensors(new)):
                if not isinstance(old, torch.Tensor):
                    continue
                same = (old.data_ptr() == fresh.data_ptr() and old.shape == fresh.shape
                        and old.stride() == fresh.stride())
                if not same:  # a result in fresh memory: the graph would have written it into the old
                    old.copy_(fresh)


class ReplayingCpu(CpuOps):
    """The cpu device with whole-step graphs: a capture runs the function and
    keeps its output tensor; a replay runs the function again on the same
    static buffers and writes the result into that tensor, which is what a
    replay promises. (Not a tape: the reference's attention sizes tensors by
    the context lengths' values, which no recording could replay; the cuda
    kernels' shapes are static.)"""
    supports_graphs = True

    def __init__(self):
        super().__init__()
        self.captured, self.replays = [], 0

    def capture_graph(self, fn, pool=None):
        out = fn()
        self.captured.append(out.shape[0])

        def replay():
            self.replays += 1
            out.copy_(fn())
        return replay, out, pool


class PieceRecordingCpu(CpuOps):
    """The cpu device as a device that records steps in pieces only (no
    whole-step graphs), each piece a tape."""
    supports_graph_pieces = True

    def __init__(self):
        super().__init__()
        self.piece_replays = 0

    def capture_pieces(self, fn, pool=None):
        fn(lambda: None)
        tapes = [Tape()]

        def cut():
            tapes[-1].__exit__(None, None, None)
            tapes.append(Tape())
            tapes[-1].__enter__()

        tapes[0].__enter__()
        try:
            out = fn(cut)
        finally:
            tapes[-1].__exit__(None, None, None)

        def replayer(tape):
            def replay():
                self.piece_replays += 1
                tape.replay()
            return replay
        return [replayer(t) for t in tapes], out, pool
