"""Build lmdeploy's compiled CUDA kernels (csrc/cuda) into the module lmdeploy.devices.cuda._C.

    python csrc/build.py                      # every default architecture, into the package (in place)
    python csrc/build.py --archs 90           # only sm90 (what the GPU at hand needs: faster)
    python csrc/build.py --out /tmp/x --jobs 2

Each ``.cu`` file is one translation unit (one kernel family), compiled once for all architectures
(``nvcc --threads`` spreads those), the units in parallel; objects are cached under ``build/csrc`` by
the hash of their sources, flags and nvcc version, so an unchanged unit is not compiled again. The
module links the CUDA runtime statically and takes raw pointers (see bindings.cpp): it needs no
torch headers, only nvcc, a C++ compiler and pybind11.

$LMDEPLOY_NVCC_FLAGS adds flags to the kernels' compiles (tuning macros in the sources).
Architectures: $LMDEPLOY_CUDA_ARCHS (e.g. "75;80;90" or "75,80,90"), else every one of sm70, sm75,
sm80, sm86, sm89, sm90 that the installed nvcc supports (CUDA 13 dropped sm70: it is skipped with a
notice), plus PTX of the newest for GPUs after it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from typing import List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(HERE, 'cuda')
PACKAGE_DIR = os.path.join(ROOT, 'lmdeploy', 'devices', 'cuda')
DEFAULT_ARCHS = (70, 75, 80, 86, 89, 90)
HEADERS = ('common.cuh', 'ops.h')
COMMON_FLAGS = ('-O3', '-std=c++17', '-Xcompiler', '-fPIC', '-I', SRC)  # kernel units and bindings alike


def find_cuda_tool(name: str) -> Optional[str]:
    """A CUDA toolkit program: from $CUDA_HOME, $CUDA_PATH or /usr/local/cuda, else on PATH."""
    for home in (os.environ.get('CUDA_HOME'), os.environ.get('CUDA_PATH'), '/usr/local/cuda'):
        if home and os.path.isfile(os.path.join(home, 'bin', name)):
            return os.path.join(home, 'bin', name)
    return shutil.which(name)


def find_nvcc() -> Optional[str]:
    return find_cuda_tool('nvcc')


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, '--version'], capture_output=True, text=True, check=True).stdout
    m = re.search(r'release (\d+\.\d+)', out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def supported_archs(nvcc: str) -> List[int]:
    out = subprocess.run([nvcc, '--list-gpu-arch'], capture_output=True, text=True).stdout
    return sorted({int(m) for m in re.findall(r'compute_(\d+)', out)})


def parse_archs(text: str) -> List[int]:
    archs = []
    for part in re.split(r'[;, ]+', text.strip()):
        part = part.lower().replace('sm_', '').replace('sm', '').replace('.', '')
        if part:
            if not part.isdigit():
                raise ValueError(f'LMDEPLOY_CUDA_ARCHS: {part!r} is not an architecture like 80 or sm_90')
            archs.append(int(part))
    return sorted(set(archs))


def default_archs(nvcc: str, log=print) -> List[int]:
    """$LMDEPLOY_CUDA_ARCHS, else the defaults the installed nvcc supports."""
    have = supported_archs(nvcc)
    wanted = parse_archs(os.environ['LMDEPLOY_CUDA_ARCHS']) if os.environ.get('LMDEPLOY_CUDA_ARCHS') else list(
        DEFAULT_ARCHS)
    dropped = [a for a in wanted if a not in have]
    if dropped:
        log(f'lmdeploy: nvcc {nvcc_version(nvcc)} cannot build sm{", sm".join(map(str, dropped))} '
            f'(CUDA 13 dropped Volta): building {", ".join(f"sm{a}" for a in wanted if a in have)}')
    return [a for a in wanted if a in have]


def gencode_flags(archs: Sequence[int]) -> List[str]:
    flags = []
    for a in archs:
        flags += ['-gencode', f'arch=compute_{a},code=sm_{a}']
    if archs:  # PTX of the newest: GPUs after it JIT-compile it
        flags += ['-gencode', f'arch=compute_{archs[-1]},code=compute_{archs[-1]}']
    return flags


def kernel_flags(gencode: Sequence[str]) -> List[str]:
    """nvcc's flags for a kernel unit (its -gencode flags given), $LMDEPLOY_NVCC_FLAGS last."""
    extra = os.environ.get('LMDEPLOY_NVCC_FLAGS', '').split()  # e.g. tuning macros: -DLMDEPLOY_DECODE_UNROLL=8
    return [*COMMON_FLAGS, '--expt-relaxed-constexpr', '-lineinfo', *gencode, *extra]


def _digest(paths: Sequence[str], flags: Sequence[str], version: str) -> str:
    """What an object depends on, named relative to the checkout: a cache built in one checkout (or on
    another machine with the same nvcc) serves another."""
    h = hashlib.sha256(version.encode())
    for p in paths:
        with open(p, 'rb') as f:
            h.update(os.path.relpath(p, ROOT).encode() + b'\0' + f.read())
    h.update('\0'.join(f.replace(ROOT, '<checkout>') for f in flags).encode())
    return h.hexdigest()[:20]


def _compile(cmd: List[str], obj: str, log) -> str:
    if os.path.isfile(obj):
        log(f'  cached {os.path.basename(obj)}')
        return obj
    tmp = obj + '.tmp'
    r = subprocess.run(cmd + ['-o', tmp], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f'compiling failed: {" ".join(cmd)}\n{r.stdout}{r.stderr}')
    os.replace(tmp, obj)
    log(f'  compiled {os.path.basename(obj)}')
    return obj


def build(archs: Optional[Sequence[int]] = None, out_dir: str = PACKAGE_DIR, cache_dir: Optional[str] = None,
          jobs: Optional[int] = None, link: bool = True, log=print) -> Optional[str]:
    """Compile every unit for ``archs`` (default: :func:`default_archs`) and link the module into
    ``out_dir``; returns its path (None with ``link=False``). Raises RuntimeError on a compile error."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError('nvcc not found (set CUDA_HOME or put nvcc on PATH)')
    version = nvcc_version(nvcc)
    archs = list(archs) if archs else default_archs(nvcc, log)
    if not archs:
        raise RuntimeError('no CUDA architecture to build for')
    cache_dir = cache_dir or os.path.join(ROOT, 'build', 'csrc')
    os.makedirs(cache_dir, exist_ok=True)
    jobs = jobs or max(1, os.cpu_count() or 1)
    units = sorted(f for f in os.listdir(SRC) if f.endswith('.cu'))
    headers = [os.path.join(SRC, h) for h in HEADERS]
    cu_flags = kernel_flags(gencode_flags(archs))
    threads = ['--threads', str(max(1, jobs // len(units)))]  # how, not what: left out of the digest
    import pybind11
    py_flags = [*COMMON_FLAGS, '-I', pybind11.get_include(), '-I', sysconfig.get_paths()['include']]
    tasks = []
    for unit in units:
        path = os.path.join(SRC, unit)
        obj = os.path.join(cache_dir, f'{unit[:-3]}-{_digest([path, *headers], cu_flags, version)}.o')
        tasks.append(([nvcc, '-c', path, *cu_flags, *threads], obj))
    binding = os.path.join(SRC, 'bindings.cpp')
    obj = os.path.join(cache_dir, f'bindings-{_digest([binding, *headers], py_flags, version + sys.version)}.o')
    tasks.append(([nvcc, '-c', binding, *py_flags], obj))
    log(f'lmdeploy: building CUDA kernels ({len(units)} units) for {", ".join(f"sm{a}" for a in archs)} '
        f'with nvcc {version}')
    with concurrent.futures.ThreadPoolExecutor(max(1, min(jobs, len(tasks)))) as pool:
        objs = list(pool.map(lambda t: _compile(t[0], t[1], log), tasks))
    if not link:
        return None
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, '_C' + sysconfig.get_config_var('EXT_SUFFIX'))
    cmd = [nvcc, '-shared', '--cudart', 'static', *objs, '-o', target + '.tmp']
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f'linking failed: {" ".join(cmd)}\n{r.stdout}{r.stderr}')
    os.replace(target + '.tmp', target)
    log(f'lmdeploy: built {target}')
    return target


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--archs', default=None, help='e.g. 80,90 (default: $LMDEPLOY_CUDA_ARCHS or all defaults)')
    p.add_argument('--out', default=PACKAGE_DIR, help='where the module goes (default: in the package)')
    p.add_argument('--cache', default=None, help='object cache (default: build/csrc)')
    p.add_argument('--jobs', type=int, default=None)
    p.add_argument('--no-link', action='store_true', help='compile only (what CI checks)')
    args = p.parse_args(argv)
    try:
        build(parse_archs(args.archs) if args.archs else None, args.out, args.cache, args.jobs,
              link=not args.no_link)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
