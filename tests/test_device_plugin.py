"""A device from another distribution: one package with an entry point in
the group ``lmdeploy.devices``, nothing edited in lmdeploy. Built here in a
temporary directory (a package and its .dist-info, which is all an install
leaves), it must be found by the registry, accepted as ``device_type``, run
a pipeline, pass the conformance suite and show in ``lmdeploy check_env``."""
import os
import subprocess
import sys
import textwrap

import pytest

from lmdeploy import devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = '''
import torch

from lmdeploy.devices.reference import ReferenceOps


class TestDevOps(ReferenceOps):
    """The reference ops on cpu tensors, counting the GEMMs it runs."""
    name = 'testdev'
    torch_device_type = 'cpu'
    auto_priority = -10  # never chosen by 'auto' over the cpu device
    linear_calls = 0

    @classmethod
    def is_available(cls):
        return True

    def memory_available(self):
        return 1 << 30

    def default_dtype(self, config_dtype):
        return torch.float32

    def supports_dtype(self, dtype):
        return dtype == torch.float32

    def linear(self, x, weight, bias=None):
        TestDevOps.linear_calls += 1
        return super().linear(x, weight, bias)
'''


@pytest.fixture
def plugin_dir(tmp_path):
    (tmp_path / 'lmdeploy_testdev').mkdir()
    (tmp_path / 'lmdeploy_testdev' / '__init__.py').write_text(textwrap.dedent(PLUGIN))
    info = tmp_path / 'lmdeploy_testdev-0.1.dist-info'
    info.mkdir()
    (info / 'METADATA').write_text('Metadata-Version: 2.1\nName: lmdeploy-testdev\nVersion: 0.1\n')
    (info / 'entry_points.txt').write_text('[lmdeploy.devices]\ntestdev = lmdeploy_testdev:TestDevOps\n')
    sys.path.insert(0, str(tmp_path))
    devices.refresh()
    yield tmp_path
    sys.path.remove(str(tmp_path))
    devices.refresh()


def test_a_registered_device_runs_a_pipeline(plugin_dir, smollm2_path):
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from lmdeploy.devices.conformance import run_self_tests
    assert devices.device_choices() == ['auto', 'cpu', 'cuda', 'ascend', 'testdev']
    assert devices.resolve_device_type('auto') != 'testdev'
    results = run_self_tests('testdev')
    assert results and all(r.passed for r in results), [r for r in results if not r.passed]
    cls = devices.load_class('testdev')
    before = cls.linear_calls
    pipe = pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='testdev', session_len=256))
    try:
        assert pipe.engine.device.name == 'testdev'
        text = pipe('What is the capital of France?', GenerationConfig(max_new_tokens=12)).text
    finally:
        pipe.close()
    assert 'Paris' in text
    assert cls.linear_calls > before  # its ops ran the model


def test_check_env_lists_and_checks_a_registered_device(plugin_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin_dir), REPO]))
    r = subprocess.run([sys.executable, '-m', 'lmdeploy', 'check_env'], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert any(line.split()[:2] == ['testdev', 'available'] for line in r.stdout.splitlines()), r.stdout
    passed = [line for line in r.stdout.splitlines() if line.split()[:1] == ['testdev'] and 'PASS' in line]
    assert len(passed) >= 8, r.stdout


def test_a_device_type_nobody_registered_is_refused():
    from lmdeploy import PytorchEngineConfig
    with pytest.raises(ValueError, match="device_type.*one of \\['auto', 'cpu'"):
        PytorchEngineConfig(device_type='nodev')


def test_two_devices_of_one_torch_type_share_a_process(plugin_dir, tiny_model_factory):
    """Two engines in one process, on the cpu device and on the registered one (both on cpu tensors), run at
    once: each model's layers call the ops of the device it was built for, so each device sees its own
    engine's work only, and both give the same tokens (both are the reference)."""
    import random
    import threading

    from engine_utils import submit

    from lmdeploy.engine.engine import Engine
    from lmdeploy.engine.sequence import SamplingParams
    from lmdeploy.messages import PytorchEngineConfig
    cls = devices.load_class('testdev')
    model = tiny_model_factory('llama')
    rng = random.Random()
    prompts = [[rng.randrange(20, 1000) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    engines = {name: Engine(model, PytorchEngineConfig(device_type=name, session_len=128))
               for name in ('cpu', 'testdev')}
    try:
        assert engines['testdev'].device.name == 'testdev' and engines['cpu'].device.name == 'cpu'
        layers = {name: {type(m.ops).__name__ for m in e.runner.model.modules() if hasattr(m, 'ops')}
                  for name, e in engines.items()}
        assert layers == {'cpu': {'CpuOps'}, 'testdev': {'TestDevOps'}}, layers
        before = cls.linear_calls
        alone = [c.wait().token_ids for c in [submit(engines['cpu'], p, SamplingParams(max_new_tokens=6))
                                             for p in prompts]]
        assert cls.linear_calls == before  # the cpu engine's model never reached the other device's ops
        results = {}

        def run(name):
            cols = [submit(engines[name], p, SamplingParams(max_new_tokens=6)) for p in prompts]
            results[name] = [c.wait().token_ids for c in cols]
        threads = [threading.Thread(target=run, args=(name, )) for name in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results['cpu'] == results['testdev'] == alone
        assert cls.linear_calls > before
    finally:
        for e in engines.values():
            e.close()
