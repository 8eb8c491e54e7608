"""Where the ascend device meets torch_npu: the one place that imports it and names the torch device.

Importing ``torch_npu`` needs CANN's libraries, so nothing imports it at module import: ``import lmdeploy``
and every other device work on machines without it. torch_npu registers the NPU as torch's PrivateUse1
backend under the name ``'npu'`` and adds the ``torch.npu`` namespace (devices, streams, events, graphs).

:data:`DEVICE_TYPE` is the torch device type every tensor of the device is allocated on; it is read here
and nowhere else. The tests' emulation of torch_npu (tests/npu_emulation) runs on CPU tensors and sets it
to ``'cpu'``: a CPU build of torch cannot create tensors of a device type no backend implements.
"""
from __future__ import annotations

import os
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
    return unusable_reason() is None


def unusable_reason() -> Optional[str]:
    """None where :func:`usable`; else what is missing: torch_npu, CANN's libraries, or an NPU."""
    try:
        ns = npu()
    except ImportError as e:
        if e.name == 'torch_npu':
            return ('torch_npu is not installed (it needs Huawei CANN and the torch_npu build matching torch; '
                    'lmdeploy/devices/ascend/README.md)')
        return f'torch_npu cannot be imported: {e} (is CANN installed and its set_env.sh sourced?)'
    except Exception as e:  # CANN's libraries failing to load
        return f'torch_npu fails to load: {type(e).__name__}: {e}'
    try:
        if ns.is_available() and ns.device_count() > 0:
            return None
    except Exception as e:
        return f'torch_npu cannot list the NPUs: {type(e).__name__}: {e}'
    hidden = os.environ.get('ASCEND_RT_VISIBLE_DEVICES')
    return ('torch_npu sees no NPU (no Ascend device or driver here' +
            (f', or ASCEND_RT_VISIBLE_DEVICES={hidden!r} hides them)' if hidden is not None else ')'))


def torch_device(index: Optional[int] = None) -> torch.device:
    """The torch device of NPU ``index`` (default: the current one)."""
    return torch.device(DEVICE_TYPE, npu().current_device() if index is None else index)
