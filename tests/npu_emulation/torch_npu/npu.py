"""The emulated ``torch.npu`` namespace: one NPU, which is the CPU, and graph capture.

Graphs: a recording keeps every aten op that ran (a TorchDispatchMode) with the very tensors it read and
wrote, and every emulated torch_npu op as one entry with its arguments; a replay runs them again on those
tensors and writes each result into the tensor the recording made, which is what a graph replay
promises. A host read of a tensor during a capture fails, as a device-to-host copy does inside an NPU
capture. ``NPUGraph.update(cpu_update_input=[...])`` replaces host arguments of the recorded ops that take
them (the fused attention's ``actual_seq_lengths`` / ``actual_seq_lengths_kv``), one dict per such op in
recording order, as torch_npu's ``auto_dispatch_capture`` does; without it a replay keeps the recorded
lists, as on an NPU.
"""
from __future__ import annotations

import itertools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _state


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(index) -> None:
    pass


def get_device_name(index: int = 0) -> str:
    return 'Ascend910B (emulated on the CPU: tests/npu_emulation)'


def synchronize() -> None:
    pass


def empty_cache() -> None:
    """torch.npu.empty_cache: the emulation's tensors live in host memory, which keeps no cache of its own."""


def mem_get_info():
    import psutil
    vm = psutil.virtual_memory()
    return int(min(vm.available, 2 << 30)), int(vm.total)


class Event:
    """An event of the emulated NPU queue: ops run as they are called, so a recorded event is reached."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing = enable_timing
        self._at = None

    def record(self, stream=None):
        import time
        self._at = time.perf_counter()

    def query(self) -> bool:
        return self._at is not None

    def synchronize(self) -> None:
        if self._at is None:
            raise RuntimeError('synchronize on an event never recorded')

    def elapsed_time(self, end) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError('events need enable_timing=True to be timed')
        return (end._at - self._at) * 1e3


def _outs(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _write_back(old, new):
    for o, n in zip(_outs(old), _outs(new)):
        if isinstance(o, torch.Tensor) and not (o.data_ptr() == n.data_ptr() and o.shape == n.shape
                                                and o.stride() == n.stride()):
            o.copy_(n)


class _Tape(TorchDispatchMode):
    """Records aten ops run outside emulated torch_npu ops (those record themselves)."""

    def __init__(self, graph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _state.depth:
            self.graph.entries.append(('aten', func, args, kwargs or {}, out))
        return out


_pools = itertools.count(1)


class NPUGraph:

    def __init__(self):
        self.entries = []
        self.auto_dispatch_capture = False
        self._pool = None

    def pool(self):
        return self._pool

    def update(self, cpu_update_input):
        if not self.auto_dispatch_capture:
            raise RuntimeError('The current graph configuration does not support update, capture with '
                               'auto_dispatch_capture=True')
        updatable = [e for e in self.entries if e[0] == 'op' and e[1].graph_updatable]
        if len(cpu_update_input) != len(updatable):
            raise RuntimeError(f'{len(cpu_update_input)} updates for {len(updatable)} updatable ops')
        for entry, changes in zip(updatable, cpu_update_input):
            unknown = set(changes) - set(entry[1].graph_updatable)
            if unknown:
                raise RuntimeError(f'cannot update {sorted(unknown)} of {entry[1].__name__}')
            entry[4][1].update(changes)

    def replay(self):
        for kind, func, args, kwargs, extra in self.entries:
            if kind == 'aten':
                _write_back(extra, func(*args, **kwargs))
            else:  # an emulated op: run again with its (possibly updated) host arguments
                out, changes = extra
                _state.depth += 1
                try:
                    new = func.__wrapped__(*args, **{**kwargs, **changes})
                finally:
                    _state.depth -= 1
                _write_back(out, new)


def _no_host_read(*args, **kwargs):
    raise RuntimeError('a device-to-host read is not allowed while an NPU graph is being captured')


class graph:
    """``with torch.npu.graph(g, pool=None, stream=None, auto_dispatch_capture=False)``: record into g."""

    def __init__(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
                 capture_error_mode='global'):
        self.npu_graph = npu_graph
        npu_graph.auto_dispatch_capture = auto_dispatch_capture
        npu_graph._pool = pool if pool is not None else next(_pools)
        self._tape = _Tape(npu_graph)

    def __enter__(self):
        if _state.recording is not None:
            raise RuntimeError('an NPU graph is already being captured')
        _state.recording = self.npu_graph
        self._saved = torch.Tensor.tolist, torch.Tensor.item
        torch.Tensor.tolist = torch.Tensor.item = _no_host_read
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        self._tape.__exit__(*exc)
        torch.Tensor.tolist, torch.Tensor.item = self._saved
        _state.recording = None
        return False


def graph_pool_handle():
    return next(_pools)
