"""Settings this build does not implement are refused clearly, not ignored."""
import pytest


def test_unimplemented_device_is_named():
    from lmdeploy.devices import get_device
    with pytest.raises(NotImplementedError, match='ascend'):
        get_device('ascend')
