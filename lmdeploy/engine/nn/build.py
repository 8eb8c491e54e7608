"""Which device a model is being built for.

A model is built inside :func:`building` with the device it will run on;
each layer keeps that device's ops (``self.ops``) and calls them directly.
So the route from a layer to its kernel is fixed when the model is built
(no lookup by tensor type at run time), and two models on two devices of the
same torch device type can live in one process.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from lmdeploy.devices.interface import DeviceOps

_building: Optional[DeviceOps] = None


@contextlib.contextmanager
def building(ops: DeviceOps) -> Iterator[DeviceOps]:
    """Layers constructed inside take ``ops`` as theirs."""
    global _building
    outer, _building = _building, ops
    try:
        yield ops
    finally:
        _building = outer


def device_ops() -> DeviceOps:
    """The ops of the device the model under construction runs on."""
    if _building is None:
        raise RuntimeError('a layer was built outside lmdeploy.engine.nn.build.building(device): a model is built '
                           'for the device it runs on')
    return _building
