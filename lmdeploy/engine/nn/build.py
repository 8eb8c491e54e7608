"""Which device a model is being built for, and in which weight format.

A model is built inside :func:`building` with the device it will run on and
the checkpoint's weight format. Each layer keeps that device's ops
(``self.ops``) and, for layers whose weights have a device-specific form,
the implementation the device gives for the format (``self.impl``:
devices/layers.py). So the route from a layer to its kernel is fixed when
the model is built (no lookup by tensor type at run time), and two models
on two devices of the same torch device type can live in one process.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional, Tuple

from lmdeploy.devices.interface import DeviceOps
from lmdeploy.devices.layers import DENSE

_building: Optional[Tuple[DeviceOps, str, Optional[Dict[str, Any]]]] = None


@contextlib.contextmanager
def building(ops: DeviceOps, weight_format: str = DENSE,
             format_config: Optional[Dict[str, Any]] = None) -> Iterator[DeviceOps]:
    """Layers constructed inside take ``ops`` as theirs, and weights in ``weight_format`` (``format_config``:
    the checkpoint's ``quantization_config``, which the format's implementations read: group size, ...)."""
    global _building
    outer, _building = _building, (ops, weight_format, format_config)
    try:
        yield ops
    finally:
        _building = outer


def _current() -> Tuple[DeviceOps, str, Optional[Dict[str, Any]]]:
    if _building is None:
        raise RuntimeError('a layer was built outside lmdeploy.engine.nn.build.building(device): a model is built '
                           'for the device it runs on')
    return _building


def device_ops() -> DeviceOps:
    """The ops of the device the model under construction runs on."""
    return _current()[0]


def layer_impl(kind: str, dense: bool = False):
    """The device's implementation of a ``kind`` layer for the checkpoint's weight format (``dense``: a layer
    the format leaves plain)."""
    ops, weight_format, config = _current()
    if dense or weight_format == DENSE:
        return ops.layer_impl(kind, DENSE)
    return ops.layer_impl(kind, weight_format, config)
