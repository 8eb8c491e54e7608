"""Device registry: one implementation of :class:`DeviceOps` per device kind.

Device packages are imported lazily, by name, only here. The engine asks for
a device by its ``device_type`` and calls ops through :mod:`.ops`, which
dispatches on the tensors' device.
"""
from __future__ import annotations

import importlib
from typing import Dict

from .interface import DeviceOps

# device_type -> "module:Class"
_DEVICES = {
    'cpu': 'lmdeploy.devices.cpu:CpuOps',
    'cuda': 'lmdeploy.devices.cuda:CudaOps',
    'ascend': 'lmdeploy.devices.ascend:AscendOps',
}
# torch's device.type -> our device_type
TORCH_TO_DEVICE = {'cpu': 'cpu', 'cuda': 'cuda', 'npu': 'ascend'}
_AUTO_ORDER = ('cuda', 'ascend', 'cpu')
_instances: Dict[str, DeviceOps] = {}


def _load_class(device_type: str):
    if device_type not in _DEVICES:
        raise ValueError(f'unknown device_type {device_type!r}; choose one of '
                         f"{['auto', *_DEVICES]}")
    module, cls = _DEVICES[device_type].split(':')
    try:
        return getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith('lmdeploy.devices.'):
            raise NotImplementedError(f"device_type {device_type!r} is not implemented in this build") from e
        raise


def is_available(device_type: str) -> bool:
    try:
        return _load_class(device_type).is_available()
    except (NotImplementedError, ImportError):
        return False


def resolve_device_type(device_type: str = 'auto') -> str:
    """'auto' picks the first available of cuda, ascend, cpu."""
    if device_type != 'auto':
        return device_type
    for name in _AUTO_ORDER:
        if is_available(name):
            return name
    return 'cpu'


def get_device(device_type: str = 'auto') -> DeviceOps:
    """The (cached) ops object of a device kind; raises if unusable here."""
    device_type = resolve_device_type(device_type)
    if device_type not in _instances:
        cls = _load_class(device_type)
        if not cls.is_available():
            raise RuntimeError(f"device_type {device_type!r} is not available on this machine")
        _instances[device_type] = cls()
    return _instances[device_type]


__all__ = ['DeviceOps', 'get_device', 'resolve_device_type', 'is_available', 'TORCH_TO_DEVICE']
