"""An interrupted ``lmdeploy lite`` quantization goes on where it stopped (lmdeploy/lite/resume.py).

A tiny Llama (2 decoder layers) is quantized once straight through, then again into another directory with the
run stopped (KeyboardInterrupt, as Ctrl-C) just after its first layer was kept. The rerun with the same arguments
loads that layer instead of searching it again (the search runs for the second layer only), and writes the
same tensors bit for bit as the straight run; its partial results are gone afterwards. A rerun with other
arguments, or with ``--no-resume``, starts over.
"""
from __future__ import annotations

import os

import pytest
import torch

KW = dict(calib_samples=4, calib_seqlen=32, w_group_size=16, device='cpu', progress=False)


def _tensors(path):
    from safetensors.torch import load_file
    files = sorted(f for f in os.listdir(path) if f.endswith('.safetensors'))
    out = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


def _interrupted(monkeypatch, run, after_layer: int):
    """``run()`` stopped by KeyboardInterrupt once layer ``after_layer`` is kept."""
    from lmdeploy.lite import resume
    save = resume.Checkpoint.save

    def save_then_stop(self, i, *a, **k):
        save(self, i, *a, **k)
        if i == after_layer:
            raise KeyboardInterrupt

    monkeypatch.setattr(resume.Checkpoint, 'save', save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(resume.Checkpoint, 'save', save)


def _count(monkeypatch, module, name: str) -> list:
    """Calls of ``module.name`` (wrapped), as a list of their first arguments."""
    calls = []
    fn = getattr(module, name)

    def counted(*a, **k):
        calls.append(a[0] if a else None)
        return fn(*a, **k)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize('tool', ['auto_awq', 'auto_gptq'])
def test_interrupted_quantization_resumes_where_it_stopped(tool, tmp_path, tiny_model_factory, monkeypatch,
                                                           capsys):
    from lmdeploy import lite
    from lmdeploy.lite import awq, gptq, resume
    monkeypatch.setattr(resume, 'INPUTS_EVERY_S', 0.0)  # the next layer's inputs kept after every layer
    src = tiny_model_factory('llama')
    quantize = getattr(lite, tool)
    extra = dict(n_grid=4) if tool == 'auto_awq' else {}
    straight = tmp_path / 'straight'
    quantize(src, str(straight), resume=False, **KW, **extra)
    assert not (straight / resume.PARTIAL).exists()

    out = tmp_path / 'out'
    _interrupted(monkeypatch, lambda: quantize(src, str(out), **KW, **extra), after_layer=0)
    assert (out / resume.PARTIAL / 'layer0.pt').is_file() and not (out / 'config.json').exists()
    capsys.readouterr()

    # the rerun searches the second layer only: AWQ's groups of layer 1, GPTQ's Hessians of layer 1's stages
    searched = _count(monkeypatch, awq, '_groups') if tool == 'auto_awq' else _count(monkeypatch, gptq,
                                                                                      '_quantize_layer')
    result = quantize(src, str(out), **KW, **extra)
    assert len(searched) == 1, len(searched)
    assert 'resuming at layer 2/2' in capsys.readouterr().err
    assert result['layers'] == 2 and len(result['alphas' if tool == 'auto_awq' else 'losses']) == 2
    want, got = _tensors(straight), _tensors(out)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert not (out / resume.PARTIAL).exists()


def test_other_arguments_or_no_resume_start_over(tmp_path, tiny_model_factory, monkeypatch, capsys):
    from lmdeploy import cli
    from lmdeploy.lite import auto_awq, awq, resume
    monkeypatch.setattr(resume, 'INPUTS_EVERY_S', 0.0)
    src = tiny_model_factory('llama')
    out = tmp_path / 'out'
    _interrupted(monkeypatch, lambda: auto_awq(src, str(out), n_grid=4, **KW), after_layer=0)
    capsys.readouterr()
    searched = _count(monkeypatch, awq, '_groups')
    auto_awq(src, str(out), n_grid=5, **KW)  # another grid: the kept layer is not this run's
    assert len(searched) == 2 and 'other arguments; starting over' in capsys.readouterr().err

    _interrupted(monkeypatch, lambda: auto_awq(src, str(out), n_grid=4, **KW), after_layer=0)
    searched.clear()
    rc = cli.main(['lite', 'auto_awq', src, '--work-dir', str(out), '--calib-samples', '4', '--calib-seqlen', '32',
                   '--w-group-size', '16', '--device', 'cpu', '--no-resume'])
    assert rc == 0 and len(searched) == 2
    assert not (out / resume.PARTIAL).exists()
