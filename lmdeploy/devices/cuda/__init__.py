from .ops import CudaOps
from .runtime import CudaRuntime

__all__ = ['CudaOps', 'CudaRuntime']
