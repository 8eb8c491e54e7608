"""The cuda device's services: CUDA memory, events, streams and graphs, NCCL between ranks; and what
``lmdeploy check_env`` says about the GPUs and the kernels each op runs (compiled.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Optional, Tuple

import torch

from ..runtime import GRAPHS_STEPS, DeviceRuntime, ExecutionPlan


class CudaRuntime(DeviceRuntime):
    torch_device_type = 'cuda'
    auto_priority = 30
    collective_backend = 'nccl'
    ray_resource = 'GPU'
    visible_devices_env = 'CUDA_VISIBLE_DEVICES'
    # whole steps recorded (decode and mixed); capture_pieces is there too (benchmark/mixed_step.py)
    PLAN = ExecutionPlan(graphs=GRAPHS_STEPS, records_mixed_steps=True, profile_memory=True)

    @classmethod
    def is_available(cls) -> bool:
        return cls.unavailable_reason() is None

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if not torch.cuda.is_available():
            if torch.version.cuda is None and getattr(torch.version, 'hip', None) is None:
                return f'this torch ({torch.__version__}) is not a CUDA build'
            hidden = os.environ.get('CUDA_VISIBLE_DEVICES')
            return ('torch sees no CUDA GPU (no NVIDIA driver or GPU here' +
                    (f', or CUDA_VISIBLE_DEVICES={hidden!r} hides them)' if hidden is not None else ')'))
        try:
            import triton  # noqa: F401
        except ImportError:
            return 'triton is not installed (pip install triton)'
        return None

    @classmethod
    def describe(cls) -> List[Tuple[str, str]]:
        rows = [('torch CUDA build', str(torch.version.cuda))]
        if getattr(torch.version, 'hip', None):
            rows.append(('torch ROCm build', str(torch.version.hip)))
        cuda_ok = bool(_safe(torch.cuda.is_available, False) is True)
        rows.append(('CUDA available', str(cuda_ok)))
        if cuda_ok:
            n = torch.cuda.device_count()
            rows.append(('CUDA devices', str(n)))
            for i in range(n):

                def gpu(i=i):
                    p = torch.cuda.get_device_properties(i)
                    return (f'{p.name} ({p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor})')

                rows.append((f'GPU {i}', _safe(gpu)))
            rows.append(('NVIDIA driver', _nvidia_driver()))
            rows.append(('cuDNN', str(_safe(torch.backends.cudnn.version))))
            rows.append(('bf16 supported', str(_safe(torch.cuda.is_bf16_supported))))
        try:
            rows.extend(kernel_rows())
        except Exception as e:  # a probe never takes check_env down
            rows.append(('compiled module', f'cannot tell ({type(e).__name__}: {e})'))
        return rows

    def torch_device(self) -> torch.device:
        return torch.device('cuda', torch.cuda.current_device())

    def set_device_index(self, index: int) -> None:
        torch.cuda.set_device(index)

    def memory_available(self) -> int:
        free, _ = torch.cuda.mem_get_info()
        return int(free)

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()

    def _hand_back_cache(self) -> None:
        """Before the first (largest) recording: a graph's pool takes none of the blocks the allocator keeps
        cached for other streams (the start-up profile's and the warm-up's activations), so they go back to
        the device first, where the pool can have them (a Llama-3-70B rank at tp=4 ran out of memory
        recording its first step with 2.65 GiB cached and 54 MiB free)."""
        self.synchronize()
        self.release_cached_memory()

    def start_peak_count(self) -> None:
        torch.cuda.synchronize()
        self._peak_base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def peak_bytes_since_start(self) -> int:
        torch.cuda.synchronize()
        return max(0, torch.cuda.max_memory_allocated() - getattr(self, '_peak_base', 0))

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def to_host_async(self, t):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait():
            done.synchronize()  # releases the GIL while the device works
            return host
        return wait

    def timestamp(self):
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def seconds_between(self, start, end):
        return start.elapsed_time(end) / 1e3 if end.query() else None

    def capture_graph(self, fn, pool=None):
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up: compiles kernels, settles the allocator
            fn()
        current.wait_stream(side)
        if pool is None:
            self._hand_back_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph.replay, out, graph.pool()

    def capture_pieces(self, fn, pool=None):
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up, as capture_graph
            fn(lambda: None)
        current.wait_stream(side)
        torch.cuda.synchronize()
        if pool is None:
            self._hand_back_cache()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        graphs = []

        def begin():
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)

        def cut():
            graphs[-1].capture_end()
            begin()

        with torch.cuda.stream(side):
            begin()
            out = fn(cut)
            graphs[-1].capture_end()
        current.wait_stream(side)
        return [g.replay for g in graphs], out, pool


def kernel_rows() -> List[Tuple[str, str]]:
    """Whether the compiled CUDA kernels (csrc/cuda) are here, and which kernel each op uses on this GPU."""
    from . import compiled
    mod = compiled.module()
    rows = [('compiled module', f'present ({mod.__file__})' if mod is not None else f'absent: {compiled.load_error()}')]
    try:
        mode = compiled.mode()
    except ValueError as e:
        return rows + [('LMDEPLOY_CUDA_KERNELS', str(e))]
    rows.append(('LMDEPLOY_CUDA_KERNELS', mode))
    try:
        if torch.cuda.is_available():
            cap = torch.cuda.get_device_capability()
            for op, calls in compiled.compiled_from(cap).items():
                kind = 'triton' if calls is None else compiled.describe_rows(calls)
                rows.append((op, f'{kind} (sm{cap[0]}{cap[1]})'))
    except Exception as e:  # a probe never takes check_env down
        rows.append(('kernel choice', f'unknown ({type(e).__name__}: {e})'))
    return rows


def _safe(fn, default='unknown'):
    try:
        return fn()
    except Exception as e:  # a probe never takes check_env down
        return f'{default} ({type(e).__name__}: {e})'


def _nvidia_driver() -> str:
    out = None
    if shutil.which('nvidia-smi'):
        try:
            r = subprocess.run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'],
                               capture_output=True, text=True, timeout=10.0)
            out = r.stdout.strip() if r.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            out = None
    if out:
        return sorted(set(line.strip() for line in out.splitlines() if line.strip()))[0]
    try:
        with open('/proc/driver/nvidia/version') as f:
            first = f.readline()
        for tok in first.split():
            if tok[:1].isdigit() and '.' in tok:
                return tok
    except OSError:
        pass
    return 'unknown (nvidia-smi not found)'
