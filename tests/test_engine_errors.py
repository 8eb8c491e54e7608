"""A device that cannot run here is refused clearly, by name, not silently replaced."""
import pytest


def test_unavailable_device_is_named():
    from lmdeploy.devices import get_device
    from lmdeploy.devices.ascend import runtime
    if runtime.usable():
        pytest.skip('an NPU is usable here')
    with pytest.raises(RuntimeError, match="'ascend' is not available"):
        get_device('ascend')
