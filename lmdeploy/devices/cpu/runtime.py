"""The cpu's services: host RAM, ops that run as they are called, gloo between ranks."""
from __future__ import annotations

from typing import List, Tuple

from ..runtime import DeviceRuntime, ExecutionPlan


class CpuRuntime(DeviceRuntime):
    torch_device_type = 'cpu'
    auto_priority = 0  # the fallback
    collective_backend = 'gloo'
    PLAN = ExecutionPlan(memory_is_host_ram=True, default_max_batch_size=64)

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def describe(cls) -> List[Tuple[str, str]]:
        try:
            import psutil
            mem = psutil.virtual_memory()
            return [('memory', f'{mem.total / 2**30:.1f} GiB total, {mem.available / 2**30:.1f} GiB available')]
        except Exception as e:  # a probe never takes check_env down
            return [('memory', f'unknown ({type(e).__name__}: {e})')]

    def memory_available(self) -> int:
        import psutil
        return int(psutil.virtual_memory().available)
