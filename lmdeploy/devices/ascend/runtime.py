"""Where the ascend device meets torch_npu: the one place that imports it and names the torch device.

Importing ``torch_npu`` needs CANN's libraries, so nothing imports it at module import: ``import lmdeploy``
and every other device work on machines without it. torch_npu registers the NPU as torch's PrivateUse1
backend under the name ``'npu'`` and adds the ``torch.npu`` namespace (devices, streams, events, graphs).

:data:`DEVICE_TYPE` is the torch device type every tensor of the device is allocated on; it is read here
and nowhere else. The tests' emulation of torch_npu (tests/npu_emulation) runs on CPU tensors and sets it
to ``'cpu'``: a CPU build of torch cannot create tensors of a device type no backend implements.

:class:`AscendRuntime` is the device's runtime (devices/runtime.py): NPU memory, events, graphs of decode
steps, HCCL between ranks, and what ``lmdeploy check_env`` says about torch_npu, CANN and the NPUs.
"""
from __future__ import annotations

import importlib.util
import os
from typing import List, Optional, Tuple

import torch

from ..runtime import GRAPHS_STEPS, DeviceRuntime, ExecutionPlan

DEVICE_TYPE = 'npu'


def torch_npu():
    """The torch_npu module (its fused ops); importing it registers ``torch.npu``."""
    import torch_npu as module
    return module


def npu():
    """The ``torch.npu`` namespace torch_npu adds to torch."""
    torch_npu()
    return torch.npu


def usable() -> bool:
    """torch_npu imports (CANN present), and it sees at least one NPU."""
    return unusable_reason() is None


def unusable_reason() -> Optional[str]:
    """None where :func:`usable`; else what is missing: torch_npu, CANN's libraries, or an NPU."""
    try:
        ns = npu()
    except ImportError as e:
        if e.name == 'torch_npu':
            return ('torch_npu is not installed (it needs Huawei CANN and the torch_npu build matching torch; '
                    'lmdeploy/devices/ascend/README.md)')
        return f'torch_npu cannot be imported: {e} (is CANN installed and its set_env.sh sourced?)'
    except Exception as e:  # CANN's libraries failing to load
        return f'torch_npu fails to load: {type(e).__name__}: {e}'
    try:
        if ns.is_available() and ns.device_count() > 0:
            return None
    except Exception as e:
        return f'torch_npu cannot list the NPUs: {type(e).__name__}: {e}'
    hidden = os.environ.get('ASCEND_RT_VISIBLE_DEVICES')
    return ('torch_npu sees no NPU (no Ascend device or driver here' +
            (f', or ASCEND_RT_VISIBLE_DEVICES={hidden!r} hides them)' if hidden is not None else ')'))


def torch_device(index: Optional[int] = None) -> torch.device:
    """The torch device of NPU ``index`` (default: the current one)."""
    return torch.device(DEVICE_TYPE, npu().current_device() if index is None else index)


ASCEND_VERIFIED = ('the ascend device is verified against an emulation of torch_npu (tests/npu_emulation), '
                   'not on an NPU, until someone runs it on one')


class AscendRuntime(DeviceRuntime):
    torch_device_type = DEVICE_TYPE  # read per instance: the emulation sets DEVICE_TYPE to 'cpu'
    auto_priority = 20  # after cuda, before cpu
    collective_backend = 'hccl'
    ray_resource = 'NPU'  # Ray's name for Ascend NPUs
    visible_devices_env = 'ASCEND_RT_VISIBLE_DEVICES'
    # decode steps recorded; steps with prompt rows stay eager: the fused attention reads sequence lengths as
    # host lists, which a recorded step would have to update per prompt; decode steps update theirs
    # (capture_graph)
    PLAN = ExecutionPlan(graphs=GRAPHS_STEPS, records_mixed_steps=False, profile_memory=True)

    def __init__(self, ops=None):
        super().__init__(ops)
        self.torch_device_type = DEVICE_TYPE

    @classmethod
    def is_available(cls) -> bool:
        return usable()

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return unusable_reason()

    @classmethod
    def describe(cls) -> List[Tuple[str, str]]:
        if importlib.util.find_spec('torch_npu') is None:
            return [('NPU (torch_npu)', 'torch_npu not installed'), ('Ascend path', ASCEND_VERIFIED)]
        try:
            module = torch_npu()
        except Exception as e:
            return [('NPU (torch_npu)', f'torch_npu not importable ({type(e).__name__}: {e})'),
                    ('Ascend path', ASCEND_VERIFIED)]
        ns = getattr(torch, 'npu', None)
        try:
            ok = bool(ns is not None and ns.is_available() is True)
        except Exception:
            ok = False
        rows = [('torch_npu', f'{getattr(module, "__version__", "unknown")} ({module.__file__})'),
                ('CANN', _cann_version()), ('Ascend path', ASCEND_VERIFIED), ('NPU available', str(ok))]
        if ok:
            n = ns.device_count()
            rows.append(('NPU devices', str(n)))
            for i in range(n):
                try:
                    name = ns.get_device_name(i)
                except Exception as e:  # a probe never takes check_env down
                    name = f'unknown ({type(e).__name__}: {e})'
                rows.append((f'NPU {i}', str(name)))
            rows.append(('Ascend driver', _ascend_driver()))
        return rows

    def torch_device(self) -> torch.device:
        return torch_device()

    def set_device_index(self, index: int) -> None:
        npu().set_device(index)

    def memory_available(self) -> int:
        free, _ = npu().mem_get_info()
        return int(free)

    def release_cached_memory(self) -> None:
        npu().empty_cache()

    def synchronize(self) -> None:
        npu().synchronize()

    def to_host_async(self, t):
        """A copy queued behind the step (non-blocking, so the host goes on to schedule the next step) and an
        NPU event recorded after it; the returned function waits for the event."""
        host = t.to('cpu', non_blocking=True, copy=True)
        done = npu().Event()
        done.record()

        def wait():
            done.synchronize()
            return host
        return wait

    def timestamp(self):
        mark = npu().Event(enable_timing=True)
        mark.record()
        return mark

    def seconds_between(self, start, end):
        return start.elapsed_time(end) / 1e3 if end.query() else None

    def capture_graph(self, fn, pool=None):
        """Record ``fn`` with torch.npu.graph. The fused attention takes its sequence lengths as host lists,
        baked into a recording; torch_npu's ``auto_dispatch_capture`` lets ``NPUGraph.update`` replace them
        before each replay, so every replay first reads the step's context lengths (the graph runner's
        static buffer the attention was recorded with) to the host: the ops (AscendOps) note the lengths
        their attention reads while ``ops._recording`` is a list."""
        ns = npu()
        fn()  # warm-up (allocator, op caches) outside the recording
        self.synchronize()
        graph = ns.NPUGraph()
        ops = self.ops
        ops._recording = []
        try:
            with ns.graph(graph, pool=pool, auto_dispatch_capture=True):
                out = fn()
        finally:
            recorded, ops._recording = ops._recording, None

        def replay():
            if recorded:
                update = {'actual_seq_lengths_kv': recorded[0].clamp(min=1).tolist()}
                graph.update(cpu_update_input=[update] * len(recorded))
            graph.replay()
        return replay, out, graph.pool()


def _cann_version() -> str:
    """CANN's toolkit version, from its install (ASCEND_TOOLKIT_HOME or the default prefix)."""
    home = os.environ.get('ASCEND_TOOLKIT_HOME') or '/usr/local/Ascend/ascend-toolkit/latest'
    for name in ('version.cfg', os.path.join('compiler', 'version.info'), os.path.join('runtime', 'version.info')):
        try:
            with open(os.path.join(home, name)) as f:
                for line in f:
                    key, _, value = line.partition('=')
                    if key.strip().lower() in ('version', 'toolkit_version') and value.strip():
                        return f'{value.strip()} ({home})'
        except OSError:
            continue
    return f'not found ({home})'


def _ascend_driver() -> str:
    for path in ('/usr/local/Ascend/driver/version.info', ):
        try:
            with open(path) as f:
                for line in f:
                    if line.lower().startswith('version='):
                        return line.split('=', 1)[1].strip()
        except OSError:
            continue
    return 'unknown'
