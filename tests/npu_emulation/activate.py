"""Run lmdeploy's ascend device on the torch_npu emulation (this directory), in this process.

``activate()`` puts the emulated ``torch_npu`` on sys.path, imports it (which adds ``torch.npu``) and
points the ascend device at CPU tensors (``lmdeploy.devices.ascend.runtime.DEVICE_TYPE``: a CPU build of
torch cannot allocate on a device type no backend implements; this is the emulation's one concession in
how devices are named). ``deactivate()`` undoes all of it, so other tests see a machine without an NPU.
"""
from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def activate():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import torch_npu  # noqa: F401  (the emulation: adds torch.npu)
    from lmdeploy.devices.ascend import runtime
    runtime.DEVICE_TYPE = 'cpu'


def deactivate():
    from lmdeploy import devices
    from lmdeploy.devices.ascend import runtime
    runtime.DEVICE_TYPE = 'npu'
    for name in [m for m in sys.modules if m == 'torch_npu' or m.startswith('torch_npu.')]:
        del sys.modules[name]
    if hasattr(torch, 'npu'):
        del torch.npu
    if HERE in sys.path:
        sys.path.remove(HERE)
    utils = sys.modules.get('transformers.utils.import_utils')  # it caches whether it saw an NPU
    clear = getattr(getattr(utils, 'is_torch_npu_available', None), 'cache_clear', None)
    if clear is not None:
        clear()
    devices._instances.pop('ascend', None)
