"""Devices: one implementation of :class:`DeviceOps` (kernels) and of :class:`DeviceRuntime` (services)
per device kind; the ops name their runtime, and a device is registered as its ops class.

Which devices exist comes from :mod:`.registry` (built-in ones and entry
points). Device modules are imported lazily, by name, only here. The
engine asks for a device by its ``device_type`` and builds its model for
that device: each layer holds the device's ops and calls them
(``lmdeploy.engine.nn.build``), so there is one route from a layer to its
kernel and no process-wide choice of device. Importing this package is
cheap: no torch until a device is loaded.
"""
from __future__ import annotations

import importlib
from typing import Dict, Optional

from .registry import ENTRY_POINT_GROUP, device_choices, device_names, refresh, registered

_instances: Dict[str, object] = {}


def load_class(device_type: str):
    """The DeviceOps subclass registered as ``device_type``."""
    devices = registered()
    if device_type not in devices:
        raise ValueError(f'unknown device_type {device_type!r}; choose one of {device_choices()}')
    module, cls = devices[device_type].split(':')
    try:
        return getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith('lmdeploy.devices.'):
            raise NotImplementedError(f'device_type {device_type!r} is not implemented in this build') from e
        raise


def is_available(device_type: str) -> bool:
    try:
        return bool(load_class(device_type).is_available())
    except (NotImplementedError, ImportError):
        return False


def unavailable_reason(device_type: str) -> Optional[str]:
    """None where the device can run here; else why not (the device's own words)."""
    try:
        cls = load_class(device_type)
    except (NotImplementedError, ImportError) as e:
        return str(e) if isinstance(e, NotImplementedError) else f'its module cannot be imported: {e}'
    return cls.unavailable_reason()


def priority(cls) -> int:
    """A device's ``auto_priority``: its runtime's (a one-class device may set it on its ops class)."""
    own = getattr(cls, 'auto_priority', None)
    return own if own is not None else getattr(getattr(cls, 'runtime_class', None), 'auto_priority', 0)


def get_runtime(device_type: str = 'auto'):
    """The runtime (services: memory, timing, graphs, process groups, the engine's plan) of a device kind:
    its ops object's (:func:`get_device`)."""
    return get_device(device_type).runtime


def resolve_device_type(device_type: str = 'auto') -> str:
    """'auto' picks the available device of highest ``auto_priority`` (cuda, then ascend, then cpu among the
    built-in ones; a registered device declares its own)."""
    if device_type != 'auto':
        return device_type
    ranked = []
    for i, name in enumerate(registered()):
        try:
            cls = load_class(name)
        except (NotImplementedError, ImportError):
            continue
        ranked.append((-priority(cls), i, name, cls))
    for _, _, name, cls in sorted(ranked, key=lambda r: r[:2]):
        try:
            if cls.is_available():
                return name
        except Exception:
            continue
    return 'cpu'


def get_device(device_type: str = 'auto'):
    """The (cached) ops object of a device kind; raises if unusable here."""
    device_type = resolve_device_type(device_type)
    if device_type not in _instances:
        cls = load_class(device_type)
        if not cls.is_available():
            why = cls.unavailable_reason() or 'its availability check failed'
            raise RuntimeError(f'device_type {device_type!r} is not available on this machine: {why}')
        _instances[device_type] = cls()
    return _instances[device_type]


def __getattr__(name):  # DeviceOps / DeviceRuntime without importing torch at package import
    if name == 'DeviceOps':
        from .interface import DeviceOps
        return DeviceOps
    if name == 'DeviceRuntime':
        from .runtime import DeviceRuntime
        return DeviceRuntime
    raise AttributeError(name)


__all__ = ['DeviceOps', 'DeviceRuntime', 'get_device', 'get_runtime', 'resolve_device_type', 'is_available', 'unavailable_reason', 'load_class',
           'device_names', 'device_choices', 'registered', 'refresh', 'ENTRY_POINT_GROUP']
