"""benchmark/mixed_step.py on a CPU stand-in for a graph device: each step
kind runs through the path it names (replayed whole, in pieces, eager)."""
import sys

from graph_emulation import ReplayingCpu
from helpers import benchmark_module

import lmdeploy.engine.engine as engine_module
from lmdeploy.engine.graph_runner import GraphRunner


def test_mixed_step_times_each_path(tiny_model_factory, monkeypatch, capsys):
    device = ReplayingCpu()
    monkeypatch.setattr(engine_module, 'get_device', lambda device_type='auto': device)
    calls = {'decode': 0, 'mixed': 0}
    for kind in calls:
        real = getattr(GraphRunner, f'_{kind}')

        def spy(self, *a, real=real, kind=kind):
            calls[kind] += 1
            return real(self, *a)
        monkeypatch.setattr(GraphRunner, f'_{kind}', spy)
    ms = benchmark_module('mixed_step')
    monkeypatch.setattr(sys, 'argv', ['mixed_step.py', '--model', tiny_model_factory('llama'), '--device', 'cpu',
                                      '--mix', '3:20', '--iters', '2', '--context', '30'])
    ms.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[:2] for r in rows] == [['3', 'decode'], ['3+20', 'graph'], ['3+20', 'eager']]
    assert all(float(r[2]) > 0 and float(r[3]) >= float(r[2]) for r in rows)
    assert calls == {'decode': 5, 'mixed': 5}  # 3 warm-up steps and 2 timed, each through its recording
