"""Programmatic dependent launch (Hopper and newer).

In a decode step at small batch every kernel is short, and the device
spends microseconds between one kernel's end and the next one's start. A
kernel launched with PDL may become resident while its predecessor still
runs; it must wait (``gdc_wait``) before reading anything the predecessor
wrote, and signals (``gdc_launch_dependents``) when its own successor may
start. Work that depends on no earlier kernel (streaming a weight) can be
issued before the wait. Off on older GPUs and under the interpreter
(``LMDEPLOY_PDL=0`` turns it off).
"""
import os

import torch
import triton
import triton.language as tl


def _supported() -> bool:
    if os.environ.get('LMDEPLOY_PDL', '1') == '0' or os.environ.get('TRITON_INTERPRET') == '1':
        return False
    try:
        if not hasattr(tl.extra.cuda, 'gdc_wait'):
            return False
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    except Exception:
        return False


ON = _supported()
# extra launch arguments for a kernel that takes a ``PDL`` constexpr
LAUNCH = {'launch_pdl': True} if ON else {}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """Inside a kernel: wait until the kernel before it has finished (its
    outputs are this one's inputs), then let the next kernel launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
