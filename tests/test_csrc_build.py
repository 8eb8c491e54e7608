"""The compiled CUDA kernels (csrc/cuda) compile for every default architecture, and the module links
and imports, on any machine with nvcc (CI has one, no GPU): a compile error fails here. Their results
are checked on a GPU in test_cuda_compiled.py."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'csrc'))
import build  # noqa: E402  (csrc/build.py)

pytestmark = pytest.mark.skipif(build.find_nvcc() is None, reason='needs nvcc')


def test_every_kernel_compiles_for_every_default_architecture(tmp_path):
    pytest.importorskip('pybind11')
    archs = build.default_archs(build.find_nvcc(), log=lambda *a: None)
    assert archs and all(a >= 75 for a in archs)
    if '13.' in build.nvcc_version(build.find_nvcc()):
        assert 70 not in archs and {75, 80, 86, 89, 90} <= set(archs)  # CUDA 13 dropped Volta
    # a cache of its own (CI starts clean; a developer's build/ cache must not hide a compile error)
    path = build.build(archs, out_dir=str(tmp_path / 'out'), cache_dir=str(tmp_path / 'cache'), log=lambda *a: None)
    assert os.path.isfile(path)
    # the module imports without a GPU (the CUDA runtime is linked in; the driver is loaded on first use)
    code = ('import importlib.util, sys; spec = importlib.util.spec_from_file_location("_C", sys.argv[1]); '
            'm = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); '
            'print(m.MAX_DECODE_SPLITS, m.decode_attention_supports(1, 8, 128, 32, 8), '
            'm.decode_attention_supports(1, 8, 96, 32, 8), m.rotary_fill_supports(0, 4, 128), '
            'm.rotary_fill_supports(0, 4, 96))')
    out = subprocess.run([sys.executable, '-c', code, path], capture_output=True, text=True, check=True).stdout
    assert out.split() == ['64', 'True', 'False', 'True', 'False']
    # objects are cached by content: a second build compiles nothing
    said = []
    build.build(archs, out_dir=str(tmp_path / 'out'), cache_dir=str(tmp_path / 'cache'), log=said.append)
    assert not any('compiled ' in s for s in said) and any('cached' in s for s in said)


def test_archs_from_the_environment(monkeypatch):
    assert build.parse_archs('sm_80; 90,75') == [75, 80, 90]
    with pytest.raises(ValueError, match='LMDEPLOY_CUDA_ARCHS'):
        build.parse_archs('hopper')
    monkeypatch.setenv('LMDEPLOY_CUDA_ARCHS', '90')
    assert build.default_archs(build.find_nvcc(), log=lambda *a: None) == [90]
    flags = build.gencode_flags([80, 90])
    assert flags[-1] == 'arch=compute_90,code=compute_90'  # PTX of the newest for later GPUs


def test_without_the_module_the_device_runs_on_triton(monkeypatch):
    from lmdeploy.devices.cuda import compiled
    if importlib.util.find_spec('lmdeploy.devices.cuda._C') is not None:
        pytest.skip('the module is built here')
    assert compiled.module() is None and 'csrc/build.py' in compiled.load_error()
    assert compiled.choose((9, 0)) == {key: 'triton' for key in compiled.CHOICES}
    assert 'paged_decode_attention[int8]' in compiled.CHOICES and 'rotary_fill_kv' in compiled.CHOICES
    monkeypatch.setenv('LMDEPLOY_CUDA_KERNELS', 'compiled')
    with pytest.raises(RuntimeError, match='compiled kernels are missing'):
        compiled.choose((9, 0))


def test_auto_keeps_small_calls_on_triton(monkeypatch):
    """auto runs a kernel taken from FASTER only for calls of AUTO_MIN_ROWS rows or more (one sequence ran
    faster on Triton's decode attention end to end on an H100); forced or before sm80, from any size."""
    from lmdeploy.devices.cuda import compiled
    monkeypatch.delenv('LMDEPLOY_CUDA_COMPILED_MIN_ROWS', raising=False)
    monkeypatch.setenv('LMDEPLOY_CUDA_KERNELS', 'auto')
    fewest = compiled.min_rows((9, 0))
    assert {k for k, rows in fewest.items() if rows} == set(compiled.FASTER)
    assert fewest['paged_decode_attention[int8]'] == compiled.AUTO_MIN_ROWS > 1
    assert compiled.min_rows((7, 5)) == {key: 0 for key in compiled.CHOICES}
    monkeypatch.setenv('LMDEPLOY_CUDA_COMPILED_MIN_ROWS', '8')
    assert compiled.min_rows((9, 0))['paged_decode_attention[int4]'] == 8
    for bad in ('many', '-1'):
        monkeypatch.setenv('LMDEPLOY_CUDA_COMPILED_MIN_ROWS', bad)
        with pytest.raises(ValueError, match='LMDEPLOY_CUDA_COMPILED_MIN_ROWS'):
            compiled.min_rows((9, 0))
    monkeypatch.setenv('LMDEPLOY_CUDA_KERNELS', 'compiled')
    assert compiled.min_rows((9, 0)) == {key: 0 for key in compiled.CHOICES}
    # what the cuda device routes by: both together (as if the module were built)
    monkeypatch.setattr(compiled, 'module', lambda: object())
    monkeypatch.setenv('LMDEPLOY_CUDA_KERNELS', 'auto')
    monkeypatch.delenv('LMDEPLOY_CUDA_COMPILED_MIN_ROWS')
    plan = compiled.compiled_from((9, 0))
    assert plan['paged_decode_attention[int8]'] == compiled.AUTO_MIN_ROWS and plan['paged_decode_attention'] is None
    assert compiled.compiled_from((7, 5)) == {key: 0 for key in compiled.CHOICES}
    assert compiled.compiled_from(None) == {key: None for key in compiled.CHOICES}


def test_decode_calls_under_the_row_bound_run_on_triton():
    """The cuda device routes each decode-attention call by its rows (the kernels themselves stubbed:
    this checks the routing only; the kernels are checked against the reference elsewhere)."""
    from types import SimpleNamespace

    import torch

    from lmdeploy.devices.cuda import compiled
    from lmdeploy.devices.cuda.ops import CudaOps
    ops = CudaOps(num_sms=132)
    key = compiled.choice_key('paged_decode_attention', 8)
    ops.compiled_from[key] = 4
    ran = []
    ops._compiled = SimpleNamespace(choice_key=compiled.choice_key,
                                    paged_decode_attention=lambda q, *a: ran.append(('compiled', len(q))) or q)
    ops._k_attention = SimpleNamespace(paged_decode_attention=lambda q, *a, **k: ran.append(('triton', len(q))) or q)
    cache = SimpleNamespace(quant_policy=8, k=None, v=None, k_scale_zero=None, v_scale_zero=None)
    for rows in (1, 3, 4, 64):
        ops.paged_decode_attention(torch.randn(rows, 8, 64), cache, None, None, 0.125, 100)
    assert ran == [('triton', 1), ('triton', 3), ('compiled', 4), ('compiled', 64)]
