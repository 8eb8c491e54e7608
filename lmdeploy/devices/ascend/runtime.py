"""Where the ascend device meets torch_npu: the one place that imports it and names the torch device.

Importing ``torch_npu`` needs CANN's libraries, so nothing imports it at module import: ``import lmdeploy``
and every other device work on machines without it. torch_npu registers the NPU as torch's PrivateUse1
backend under the name ``'npu'`` and adds the ``torch.npu`` namespace (devices, streams, events, graphs).

:data:`DEVICE_TYPE` is the torch device type every tensor of the device is allocated on; it is read here
and nowhere else. The tests' emulation of torch_npu (tests/npu_emulation) runs on CPU tensors and sets it
to ``'cpu'``: a CPU build of torch cannot create tensors of a device type no backend implements.
"""
from __future__ import annotations

from typing import Optional

import torch

DEVICE_TYPE = 'npu'


def torch_npu():
    """The torch_npu module (its fused ops); importing it registers ``torch.npu``."""
    import torch_npu as module
    return module


def npu():
    """The ``torch.npu`` namespace torch_npu adds to torch."""
    torch_npu()
    return torch.npu


def usable() -> bool:
    """torch_npu imports (CANN present), and it sees at least one NPU."""
    try:
        ns = npu()
        return bool(ns.is_available()) and ns.device_count() > 0
    except Exception:  # ImportError, or CANN's libraries failing to load
        return False


def torch_device(index: Optional[int] = None) -> torch.device:
    """The torch device of NPU ``index`` (default: the current one)."""
    return torch.device(DEVICE_TYPE, npu().current_device() if index is None else index)
