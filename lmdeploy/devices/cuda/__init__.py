from .ops import CudaOps

__all__ = ['CudaOps']
