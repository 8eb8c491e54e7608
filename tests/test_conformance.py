"""The devices' conformance suite (lmdeploy/devices/conformance.py), run on
every device available in this process: cpu always, cuda on a GPU, and any
device an installed package registers. ``lmdeploy check_env`` runs the
same suite."""
import pytest

from lmdeploy import devices
from lmdeploy.devices.conformance import check_names, run_self_tests


def _cases():
    """(device, check) for every available device and every check it goes through (a quantized-cache
    check only where the device implements that quantization)."""
    return [(name, check) for name in devices.device_names() if devices.is_available(name)
            for check in check_names(devices.load_class(name)() if name != 'cpu' else None)]


@pytest.mark.parametrize('device_type,check', _cases())
def test_device_conforms(device_type, check):
    results = run_self_tests(device_type, only={check})
    assert [r.op for r in results] == [check], results
    assert results[0].passed, results[0].detail

