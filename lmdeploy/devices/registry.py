"""Which devices exist: the built-in ones, and those other distributions declare.

A device is a :class:`~lmdeploy.devices.interface.DeviceOps` subclass named
``"module:Class"``. The built-in ones are listed here; a package adds one
with an entry point in the group ``lmdeploy.devices`` (its name is the
``device_type``), e.g. in its pyproject.toml::

    [project.entry-points."lmdeploy.devices"]
    mydev = "mydev_lmdeploy:MyDevOps"

and nothing else in lmdeploy changes: config validation, the CLI's
``--device`` choices, the server and ``check_env`` all list devices from
here. Listing names imports neither torch nor any device module; a device's
class loads when it is asked for (:func:`lmdeploy.devices.load_class`).
"""
from __future__ import annotations

import functools
import logging
from typing import Dict, List

ENTRY_POINT_GROUP = 'lmdeploy.devices'

BUILTIN: Dict[str, str] = {
    'cpu': 'lmdeploy.devices.cpu:CpuOps',
    'cuda': 'lmdeploy.devices.cuda:CudaOps',
    'ascend': 'lmdeploy.devices.ascend:AscendOps',
}


@functools.lru_cache(maxsize=1)
def registered() -> Dict[str, str]:
    """device_type -> "module:Class": the built-in devices, then those of installed entry points
    (a built-in name cannot be taken over)."""
    from importlib.metadata import entry_points
    found = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in ('auto', *BUILTIN) or (ep.name in found and found[ep.name] != ep.value):
            logging.getLogger('lmdeploy').warning('ignoring the device entry point %s = %s: the name %r is taken',
                                                  ep.name, ep.value, ep.name)
            continue
        found[ep.name] = ep.value
    return found


def device_names() -> List[str]:
    return list(registered())


def device_choices() -> List[str]:
    """What ``device_type`` / ``--device`` accepts."""
    return ['auto', *registered()]


def refresh():
    """Look for entry points again (after installing a device package in this process)."""
    registered.cache_clear()
