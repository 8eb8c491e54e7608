"""The compiled CUDA kernels (csrc/cuda) compile for every default architecture, and the module links
and imports, on any machine with nvcc (CI has one, no GPU): a compile error fails here. Their results
are checked on a GPU in test_cuda_compiled.py."""
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
from background import BACKGROUND_POPEN, Background, lower_priority

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'csrc'))
import build  # noqa: E402  (csrc/build.py)
import sass_loops  # noqa: E402  (csrc/sass_loops.py)

pytestmark = pytest.mark.skipif(build.find_nvcc() is None, reason='needs nvcc')


class _Build:
    """csrc/build.py's build of every default architecture into a fresh temporary cache (CI starts clean;
    a developer's build/ cache must not hide a compile error), run in a subprocess at the lowest priority,
    begun when collection is done (tests/background.py): about 100 s of nvcc, done while other tests run."""

    def __init__(self, archs):
        self.archs, self.tmp = archs, tempfile.mkdtemp(prefix='lmdeploy-csrc-build-')
        self.out_dir, self.cache_dir = os.path.join(self.tmp, 'out'), os.path.join(self.tmp, 'cache')
        code = ('import sys; sys.path.insert(0, sys.argv[1]); import build; '
                'print("built", build.build([int(a) for a in sys.argv[2].split(",")], out_dir=sys.argv[3], '
                'cache_dir=sys.argv[4], log=lambda *a: None))')
        self.log = open(os.path.join(self.tmp, 'build.log'), 'w+')
        self.proc = subprocess.Popen([sys.executable, '-c', code, os.path.join(ROOT, 'csrc'), ','.join(map(str, archs)),
                                      self.out_dir, self.cache_dir],
                                     stdout=self.log, stderr=subprocess.STDOUT, **BACKGROUND_POPEN)
        lower_priority(self.proc.pid)

    def result(self, timeout):
        """(archs, the module's path or None, the build's output, out dir, cache dir)."""
        self.proc.wait(timeout)
        self.log.seek(0)
        text = self.log.read()
        built = [line.split(' ', 1)[1] for line in text.splitlines() if line.startswith('built ')]
        return self.archs, built[-1] if built and self.proc.returncode == 0 else None, text, self.out_dir, \
            self.cache_dir

    def pids(self):
        return [self.proc.pid]

    def cancel(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # nvcc's children too
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _begin_build(items):
    if build.find_nvcc() is None or importlib.util.find_spec('pybind11') is None:
        return None  # the test skips
    return _Build(build.default_archs(build.find_nvcc(), log=lambda *a: None))


def _serves(item) -> bool:
    return getattr(item, 'originalname', None) == 'test_every_kernel_compiles_for_every_default_architecture'


background = Background(serves=_serves, begin=_begin_build)


@pytest.fixture(scope='module')
def full_build(request):
    return background.result(request.session)


def test_every_kernel_compiles_for_every_default_architecture(full_build):
    pytest.importorskip('pybind11')
    archs, path, output, out_dir, cache_dir = full_build
    assert archs and all(a >= 75 for a in archs)
    assert archs == build.default_archs(build.find_nvcc(), log=lambda *a: None)
    if '13.' in build.nvcc_version(build.find_nvcc()):
        assert 70 not in archs and {75, 80, 86, 89, 90} <= set(archs)  # CUDA 13 dropped Volta
    assert path is not None, output[-5000:]  # a compile error: build.build raised, with nvcc's output
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
    build.build(archs, out_dir=out_dir, cache_dir=cache_dir, log=said.append)
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
    assert compiled.compiled_from((9, 0)) == {key: None for key in compiled.CHOICES}
    assert 'paged_decode_attention[int8]' in compiled.CHOICES and 'rotary_fill_kv' in compiled.CHOICES
    monkeypatch.setenv('LMDEPLOY_CUDA_KERNELS', 'compiled')
    with pytest.raises(RuntimeError, match='compiled kernels are missing'):
        compiled.compiled_from((9, 0))


def test_auto_runs_compiled_kernels_only_where_measured_faster(monkeypatch):
    """auto runs a compiled kernel for the calls FASTER lists for the GPU (per op, KV policy and rows: on an
    H100 a prompt chunk fills the int4 cache faster with Triton's kernel); forced or before sm80, for every
    call; triton or no GPU, never."""
    from lmdeploy.devices.cuda import compiled
    monkeypatch.delenv('LMDEPLOY_CUDA_COMPILED_MIN_ROWS', raising=False)
    monkeypatch.setattr(compiled, 'module', lambda: object())  # as if the module were built
    monkeypatch.setenv('LMDEPLOY_CUDA_KERNELS', 'auto')
    plan = compiled.compiled_from((9, 0))
    assert {k for k, rows in plan.items() if rows is not None} == set(compiled.FASTER)
    int8, int4 = plan['paged_decode_attention[int8]'], plan['paged_decode_attention[int4]']
    assert 1 in int8 and 256 in int8 and 1 in int4 and plan['paged_decode_attention'] is None
    fill = plan['rotary_fill_kv[int4]']  # a range that stops: measured faster up to 256 tokens
    assert 1 in fill and 256 in fill and 2048 not in fill and plan['rotary_fill_kv'] is None
    assert compiled.compiled_from((8, 6)) == {key: None for key in compiled.CHOICES}  # nothing measured there
    assert compiled.compiled_from((7, 5)) == {key: compiled.ANY for key in compiled.CHOICES}
    assert compiled.compiled_from(None) == {key: None for key in compiled.CHOICES}
    monkeypatch.setenv('LMDEPLOY_CUDA_COMPILED_MIN_ROWS', '8')
    moved = compiled.compiled_from((9, 0))
    assert moved['paged_decode_attention[int8]'].start == moved['rotary_fill_kv[int4]'].start == 8
    assert moved['rotary_fill_kv[int4]'].stop == fill.stop
    for bad in ('many', '-1'):
        monkeypatch.setenv('LMDEPLOY_CUDA_COMPILED_MIN_ROWS', bad)
        with pytest.raises(ValueError, match='LMDEPLOY_CUDA_COMPILED_MIN_ROWS'):
            compiled.compiled_from((9, 0))
    monkeypatch.setenv('LMDEPLOY_CUDA_KERNELS', 'compiled')
    assert compiled.compiled_from((9, 0)) == {key: compiled.ANY for key in compiled.CHOICES}
    monkeypatch.setenv('LMDEPLOY_CUDA_KERNELS', 'triton')
    assert compiled.compiled_from((9, 0)) == {key: None for key in compiled.CHOICES}
    monkeypatch.setenv('LMDEPLOY_CUDA_KERNELS', 'fast')
    with pytest.raises(ValueError, match='LMDEPLOY_CUDA_KERNELS'):
        compiled.compiled_from((9, 0))
    words = {compiled.describe_rows(r) for r in (compiled.ANY, range(64, compiled.ANY.stop), fill, range(8, 257))}
    assert words == {'compiled', 'compiled from 64 rows a call, triton below',
                     'compiled up to 256 rows a call, triton above', 'compiled for 8-256 rows a call, triton otherwise'}


def test_calls_outside_the_rows_run_on_triton():
    """The cuda device routes each decode-attention and rotary-fill call by its rows (the kernels
    themselves stubbed: this checks the routing only; the kernels are checked against the reference
    elsewhere)."""
    from types import SimpleNamespace

    import torch

    from lmdeploy.devices.cuda import compiled
    from lmdeploy.devices.cuda.ops import CudaOps
    ops = CudaOps(num_sms=132)
    key = compiled.choice_key('paged_decode_attention', 8)
    ops.compiled_from[key] = range(4, 100)
    ran = []
    ops._compiled = SimpleNamespace(choice_key=compiled.choice_key,
                                    paged_decode_attention=lambda q, *a, **k: ran.append(('compiled', len(q))) or q)
    ops._k_attention = SimpleNamespace(paged_decode_attention=lambda q, *a, **k: ran.append(('triton', len(q))) or q)
    cache = SimpleNamespace(quant_policy=8, k=None, v=None, k_scale_zero=None, v_scale_zero=None, k_mean=None,
                            rows=None)
    for rows in (1, 3, 4, 64, 100):
        ops.paged_decode_attention(torch.randn(rows, 8, 64), cache, None, None, 0.125, 100)
    assert ran == [('triton', 1), ('triton', 3), ('compiled', 4), ('compiled', 64), ('triton', 100)]
    ran.clear()
    ops.compiled_from[compiled.choice_key('rotary_fill_kv', 4)] = range(0, 257)
    ops._compiled.rotary_fill_kv = lambda q, *a, **k: ran.append(('compiled', len(q))) or (q, q)
    ops._k_kv = SimpleNamespace(rotary_fill_kv=lambda q, *a, **k: ran.append(('triton', len(q))) or (q, q))
    cache.quant_policy = 4
    for rows in (1, 256, 257, 2048):
        ops.rotary_fill_kv(torch.randn(rows, 8, 64), None, None, None, None, cache, None)
    assert ran == [('compiled', 1), ('compiled', 256), ('triton', 257), ('triton', 2048)]


def test_check_env_says_which_kernel_each_op_runs(monkeypatch):
    """check_env's table of kernels on a GPU (the cuda runtime's describe()) (its probe is faked here: this machine has none)."""
    from types import SimpleNamespace

    import torch

    from lmdeploy.devices.cuda import compiled
    from lmdeploy.devices.cuda.runtime import kernel_rows
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda *a: (9, 0))
    monkeypatch.setattr(compiled, 'module', lambda: SimpleNamespace(__file__='/x/_C.so'))
    monkeypatch.setenv('LMDEPLOY_CUDA_KERNELS', 'auto')
    monkeypatch.delenv('LMDEPLOY_CUDA_COMPILED_MIN_ROWS', raising=False)
    rows = dict(kernel_rows())
    assert rows['compiled module'] == 'present (/x/_C.so)'
    assert rows['paged_decode_attention[int8]'] == rows['paged_decode_attention[int4]'] == 'compiled (sm90)'
    assert rows['rotary_fill_kv[int4]'] == 'compiled up to 256 rows a call, triton above (sm90)'
    assert rows['paged_decode_attention'] == rows['rotary_fill_kv'] == 'triton (sm90)'


def test_compiled_fill_is_given_the_mean_key(monkeypatch):
    """The compiled rotary fill gets the int4 cache's mean key (devices/cache.py), a null pointer for a cache
    without one (the module faked: the kernel itself runs in tests/test_cuda_compiled.py on a GPU)."""
    from types import SimpleNamespace

    import torch

    from lmdeploy.devices.cache import standard_spec
    from lmdeploy.devices.cuda import compiled
    launched = []
    fake = SimpleNamespace(rotary_fill_supports=lambda *a: True, rotary_fill_kv=lambda *a: launched.append(a))
    monkeypatch.setattr(compiled, 'module', lambda: fake)
    monkeypatch.setattr(compiled, '_pdl', lambda device: 0)
    monkeypatch.setattr(torch.cuda, 'current_stream', lambda device=None: SimpleNamespace(cuda_stream=0))
    cache = standard_spec(2, 64, 16, torch.float16, 4).allocate(2, 'cpu')
    q, k, v = torch.randn(3, 4, 64).half(), torch.randn(3, 2, 64).half(), torch.randn(3, 2, 64).half()
    cos, sin, slots = torch.rand(3, 64), torch.rand(3, 64), torch.arange(3)
    assert compiled.rotary_fill_kv(q, k, v, cos, sin, cache, slots) is not None
    cache.set_key_mean(torch.randn(2, 64))
    assert compiled.rotary_fill_kv(q, k, v, cos, sin, cache, slots) is not None
    # (q, k, v, out, cos, sin, slots, k cache, v cache, k scales, v scales, k mean, ...): out is new each call
    assert launched[0][4:11] == launched[1][4:11] and launched[0][:3] == launched[1][:3]
    assert launched[0][11] == 0 and launched[1][11] == cache.k_mean.data_ptr() != 0


def test_the_decode_kernels_tile_loop_as_its_sass_shows_it():
    """csrc/sass_loops.py reads each kernel's loops from its SASS (sm90). The tensor-core decode kernel's
    tile loop holds the D / 16 mmas of S^T = K Q^T and the D / 16 of O^T = V^T P^T, one 16-byte cp.async a
    lane for each 16 x 32 bytes of K rows and of V rows (and one 4-byte copy of a scale and zero for a
    quantized cache), and six exponentials (two corrections, four probabilities)."""
    if sass_loops.find_nvdisasm() is None or shutil.which('c++filt') is None:
        pytest.skip('needs nvdisasm (pip install nvidia-cuda-nvdisasm) and c++filt')
    kernels = sass_loops.disassemble('decode_attention_mma', 90)
    seen = set()
    for k in kernels:
        m = re.search(r'decode_mma_kernel<(__half|__nv_bfloat16), (\d+), (\d+)>', k.name)
        assert m, k.name
        policy, d = int(m.group(2)), int(m.group(3))
        seen.add((m.group(1), policy, d))
        loop = k.main_loop
        row_bytes = {0: 2 * d, 8: d, 4: d // 2}[policy]
        pieces = 16 * row_bytes // (16 * 32)  # a lane's 16-byte copies of a 16-token tile's K rows (or V rows)
        assert loop.family('HMMA') == 2 * d // 16, (k.name, loop.ops)
        assert loop.ops.count('LDGSTS.E.BYPASS.128') == 2 * pieces, (k.name, loop.ops)
        assert loop.family('LDGSTS') == 2 * pieces + (policy != 0), (k.name, loop.ops)
        assert loop.ops.count('MUFU.EX2') == 6, (k.name, loop.ops)
    assert seen == {(t, p, d) for t in ('__half', '__nv_bfloat16') for p in (0, 8, 4) for d in (64, 128)}
