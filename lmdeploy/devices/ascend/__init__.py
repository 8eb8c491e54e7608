from .ops import AscendOps

__all__ = ['AscendOps']
