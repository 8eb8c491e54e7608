"""Settings this build does not implement are refused clearly, not ignored."""
import pytest

from lmdeploy.engine.engine import Engine
from lmdeploy.messages import PytorchEngineConfig


@pytest.mark.parametrize('kwargs, words', [(dict(tp=2), 'tensor parallelism')])
def test_unimplemented_settings_raise(tiny_model_factory, kwargs, words):
    with pytest.raises(NotImplementedError, match=words):
        Engine(tiny_model_factory('llama'), PytorchEngineConfig(device_type='cpu', **kwargs))


def test_unimplemented_device_is_named():
    from lmdeploy.devices import get_device
    with pytest.raises(NotImplementedError, match='ascend'):
        get_device('ascend')
