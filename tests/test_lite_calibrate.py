"""``lmdeploy lite calibrate`` (lmdeploy/lite/calibrate.py) on a tiny random Llama: the per-channel statistics of
every decoder linear's input equal those of the same calibration windows run through the whole transformers
model at once (forward hooks), and ``smooth_quant --calib-stats`` reusing them writes the same checkpoint as
smooth_quant calibrating by itself; statistics that do not fit the model are refused by name."""
from __future__ import annotations

import json
import os

import pytest
import torch

SAMPLES, SEQLEN = 3, 24


@pytest.fixture(scope='module')
def calibrated(tiny_model_factory, tmp_path_factory):
    from lmdeploy import cli
    src = tiny_model_factory('llama')
    out = tmp_path_factory.mktemp('calib')
    rc = cli.main(['lite', 'calibrate', src, '--work-dir', str(out), '--calib-samples', str(SAMPLES),
                   '--calib-seqlen', str(SEQLEN), '--device', 'cpu'])
    assert rc == 0
    return src, str(out)


def test_statistics_are_those_of_the_whole_model(calibrated):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmdeploy.lite.calib import calib_tokens
    from lmdeploy.lite.common import LINEARS
    src, out = calibrated
    stats = torch.load(os.path.join(out, 'inputs_stats.pt'), weights_only=True)
    with open(os.path.join(out, 'calibration.json')) as f:
        assert json.load(f)['calib_tokens'] == SAMPLES * SEQLEN
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tokens = calib_tokens(AutoTokenizer.from_pretrained(src), None, SAMPLES, SEQLEN)
    seen = {}
    hooks = [model.get_submodule(f'model.layers.{i}.{n}').register_forward_pre_hook(
        lambda m, args, key=f'model.layers.{i}.{n}': seen.setdefault(key, []).append(
            args[0].reshape(-1, args[0].shape[-1]).double()))
        for i in range(len(model.model.layers)) for n in LINEARS]
    with torch.no_grad():
        for row in tokens:
            model(input_ids=row[None], use_cache=False)
    for h in hooks:
        h.remove()
    assert set(stats['absmax']) == set(seen) and len(seen) == 7 * len(model.model.layers)
    for key, parts in seen.items():
        x = torch.cat(parts)
        want = {'absmax': x.abs().amax(0), 'absmean': x.abs().mean(0), 'max': x.amax(0), 'min': x.amin(0),
                'mean': x.mean(0)}
        for stat, value in want.items():
            got = stats[stat][key].double()
            assert torch.allclose(got, value, rtol=1e-4, atol=1e-5 * float(x.abs().max())), (key, stat)


def test_smooth_quant_reuses_the_statistics(calibrated, tmp_path):
    from safetensors.torch import load_file

    from lmdeploy.lite import smooth_quant
    src, stats = calibrated
    own, reused = str(tmp_path / 'own'), str(tmp_path / 'reused')
    smooth_quant(src, own, calib_samples=SAMPLES, calib_seqlen=SEQLEN, device='cpu', progress=False)
    summary = smooth_quant(src, reused, calib_stats=stats, device='cpu', progress=False)
    assert summary['calib_tokens'] == SAMPLES * SEQLEN
    a, b = load_file(os.path.join(own, 'model.safetensors')), load_file(os.path.join(reused, 'model.safetensors'))
    assert a.keys() == b.keys()
    for name in a:
        if a[name].dtype == torch.int8:  # a rounding tie may land one step apart
            assert int((a[name].int() - b[name].int()).abs().max()) <= 1, name
        else:
            assert torch.allclose(a[name].float(), b[name].float(), rtol=1e-4, atol=1e-6), name


def test_statistics_that_do_not_fit_are_refused(calibrated, tmp_path):
    from lmdeploy.lite import smooth_quant
    src, stats = calibrated
    data = torch.load(os.path.join(stats, 'inputs_stats.pt'), weights_only=True)
    del data['absmax']['model.layers.1.mlp.down_proj']
    torch.save(data, tmp_path / 'inputs_stats.pt')
    with pytest.raises(ValueError, match=r'no absmax for model\.layers\.1\.mlp\.down_proj'):
        smooth_quant(src, str(tmp_path / 'out'), calib_stats=str(tmp_path), device='cpu', progress=False)
    data = torch.load(os.path.join(stats, 'inputs_stats.pt'), weights_only=True)
    data['absmax']['model.layers.0.mlp.down_proj'] = data['absmax']['model.layers.0.mlp.down_proj'][:-1]
    torch.save(data, tmp_path / 'inputs_stats.pt')
    with pytest.raises(ValueError, match=r'model\.layers\.0\.mlp\.down_proj has \(\d+,\) channels'):
        smooth_quant(src, str(tmp_path / 'out'), calib_stats=str(tmp_path), device='cpu', progress=False)
    with pytest.raises(FileNotFoundError, match='lmdeploy lite calibrate'):
        smooth_quant(src, str(tmp_path / 'out'), calib_stats=str(tmp_path / 'none'), device='cpu', progress=False)
