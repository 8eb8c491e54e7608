"""A device that cannot run here is refused clearly, by name, not silently replaced."""
import pytest


def test_unavailable_device_is_named():
    from lmdeploy.devices import get_device
    from lmdeploy.devices.ascend import runtime
    if runtime.usable():
        pytest.skip('an NPU is usable here')
    with pytest.raises(RuntimeError, match="'ascend' is not available"):
        get_device('ascend')


def test_unavailable_device_says_why(capsys):
    """`--device ascend` / `--device cuda` where they cannot run: the refusal says what is missing."""
    import torch

    from lmdeploy import cli, devices
    from lmdeploy.cli.check_env import collect_devices
    from lmdeploy.devices.ascend import runtime
    if runtime.usable() or torch.cuda.is_available():
        pytest.skip('an accelerator is usable here')
    ascend_why = devices.unavailable_reason('ascend')
    assert 'torch_npu is not installed' in ascend_why and 'CANN' in ascend_why
    with pytest.raises(RuntimeError, match="'ascend' is not available on this machine: torch_npu is not installed"):
        devices.get_device('ascend')
    if torch.version.cuda is None:
        assert devices.unavailable_reason('cuda') == f'this torch ({torch.__version__}) is not a CUDA build'
    assert devices.unavailable_reason('cpu') is None
    rows = {name: (ok, note) for name, ok, note in collect_devices()}
    assert rows['ascend'] == (False, f'not available on this machine: {ascend_why}') and rows['cpu'][0]
    assert cli.main(['generate', '--device', 'ascend', 'Hi']) == 2
    assert capsys.readouterr().err.strip() == \
        f"error: device_type 'ascend' is not available on this machine: {ascend_why}"


def test_a_device_without_a_reason_of_its_own_still_gets_one():
    from lmdeploy.devices.cpu import CpuOps

    class Gone(CpuOps):

        @classmethod
        def is_available(cls):
            return False

    assert Gone.unavailable_reason() == 'Gone.is_available() is False here'
    assert CpuOps.unavailable_reason() is None
