"""The cpu device: the reference ops (devices/reference.py) on the cpu's runtime (runtime.py)."""
from __future__ import annotations

import torch

from ..reference import ReferenceOps
from .runtime import CpuRuntime


class CpuOps(ReferenceOps):
    name = 'cpu'
    runtime_class = CpuRuntime

    def default_dtype(self, config_dtype: torch.dtype) -> torch.dtype:
        # half precision on a CPU is slow and inexact: run float32 unless asked
        return torch.float32

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.float16, torch.bfloat16)
