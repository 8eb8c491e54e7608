from .ops import CpuOps

__all__ = ['CpuOps']
