from .ops import CpuOps
from .runtime import CpuRuntime

__all__ = ['CpuOps', 'CpuRuntime']
