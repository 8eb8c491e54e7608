"""The cpu device: the reference ops (devices/reference.py) with the cpu's services."""
from __future__ import annotations

import torch

from ..reference import ReferenceOps


class CpuOps(ReferenceOps):
    name = 'cpu'
    torch_device_type = 'cpu'
    auto_priority = 0  # the fallback
    collective_backend = 'gloo'
    default_max_batch_size = 64
    memory_is_host_ram = True

    @classmethod
    def is_available(cls) -> bool:
        return True

    def memory_available(self) -> int:
        import psutil
        return int(psutil.virtual_memory().available)

    def default_dtype(self, config_dtype: torch.dtype) -> torch.dtype:
        # half precision on a CPU is slow and inexact: run float32 unless asked
        return torch.float32

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.float16, torch.bfloat16)
