"""Triton kernels of the cuda device (they also run under TRITON_INTERPRET=1)."""
