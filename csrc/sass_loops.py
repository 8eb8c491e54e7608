"""The instructions a compiled kernel's loops run, read from its SASS: kernel work on a machine without a GPU.

    python csrc/sass_loops.py decode_attention_mma                    # every kernel of the unit, sm90
    python csrc/sass_loops.py decode_attention_mma --kernel "__half, 4, 128" --dump   # one, its main loop
    python csrc/sass_loops.py decode_attention_mma --flags=-DLMDEPLOY_DECODE_MMA_STAGES\\(P\\)=3

A decode kernel's main loop is what a warp runs for each tile of the context, so an issue-bound kernel's
speed follows its instruction count (and its mix: mma, copies, exponentials, byte permutes). The counts
are static: a branch inside a loop counts whole, so an experiment that adds a fast path next to the slow
one shows as more instructions (read --dump). Compiled with the flags build.py gives the module
($LMDEPLOY_NVCC_FLAGS included). Needs nvdisasm: from the CUDA toolkit (found as build.py finds nvcc),
or from PyPI (``pip install nvidia-cuda-nvdisasm``, part of the test extra).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build  # noqa: E402  (csrc/build.py)

# instruction families worth a column: tensor-core mma, async copies, special functions, permutes, shuffles
FAMILIES = ('HMMA', 'LDGSTS', 'LDS', 'MUFU', 'PRMT', 'SHFL', 'IMAD', 'FMUL', 'FFMA')


def find_nvdisasm() -> Optional[str]:
    found = build.find_cuda_tool('nvdisasm')
    if found:
        return found
    for site in sys.path:  # PyPI's nvidia-cuda-nvdisasm: nvidia/cu<major>/bin/nvdisasm
        hits = sorted(glob.glob(os.path.join(site, 'nvidia', '*', 'bin', 'nvdisasm')))
        if hits:
            return hits[-1]
    return None


@dataclass
class Loop:
    start: int  # addresses of its first and last (the backward branch) instructions
    end: int
    ops: List[str] = field(default_factory=list)  # opcodes, predicates dropped (e.g. 'HMMA.16816.F32')

    @property
    def count(self) -> int:
        return len(self.ops)

    def family(self, name: str) -> int:
        return sum(1 for op in self.ops if op.split('.')[0] == name)


@dataclass
class Kernel:
    name: str  # demangled where c++filt is there
    instructions: List[Tuple[int, str]]  # (address, instruction text)
    loops: List[Loop]

    @property
    def main_loop(self) -> Optional[Loop]:
        """The loop with the most instructions (a decode kernel's tile loop)."""
        return max(self.loops, key=lambda loop: loop.count, default=None)


def _opcode(text: str) -> str:
    words = text.split()
    return words[1] if words[0].startswith('@') else words[0]


def parse(sass: str) -> List[Kernel]:
    """Kernels and their loops (a backward branch to a label closes one) from ``nvdisasm -c`` output."""
    parts = re.split(r'\n\s*\.text\.(\S+):', sass)
    names = parts[1::2]
    demangled = names
    if names and shutil.which('c++filt'):
        out = subprocess.run(['c++filt'], input='\n'.join(names), capture_output=True, text=True).stdout.split('\n')
        demangled = out[:len(names)] if len(out) >= len(names) else names
    kernels = []
    for name, body in zip(demangled, parts[2::2]):
        labels: Dict[str, int] = {m.group(1): int(m.group(2), 16)
                                  for m in re.finditer(r'\.(L_x_\d+):\s*\n\s*/\*([0-9a-f]+)\*/', body)}
        instructions = [(int(a, 16), text.strip()) for a, text in re.findall(r'/\*([0-9a-f]{4,})\*/\s+([^;]*);', body)]
        loops = []
        for addr, text in instructions:
            m = re.search(r'\bBRA\b.*\.(L_x_\d+)', text)
            if m and labels.get(m.group(1), addr + 1) < addr:
                start = labels[m.group(1)]
                loops.append(Loop(start, addr, [_opcode(t) for a, t in instructions if start <= a <= addr]))
        kernels.append(Kernel(name, instructions, loops))
    return kernels


def disassemble(unit: str, arch: int = 90, flags: Sequence[str] = ()) -> List[Kernel]:
    """Compile csrc/cuda/<unit>.cu for one architecture and read its kernels."""
    nvcc, nvdisasm = build.find_nvcc(), find_nvdisasm()
    if nvcc is None or nvdisasm is None:
        raise RuntimeError('needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm)')
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, f'{unit}.cubin')
        # the flags the module is built with (a cubin holds one target: no PTX beside it)
        gencode = ['-gencode', f'arch=compute_{arch},code=sm_{arch}']
        cmd = [nvcc, '-cubin', *build.kernel_flags(gencode), *flags, os.path.join(build.SRC, f'{unit}.cu'),
               '-o', cubin]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f'compiling failed: {" ".join(cmd)}\n{r.stdout}{r.stderr}')
        sass = subprocess.run([nvdisasm, '-c', cubin], capture_output=True, text=True, check=True).stdout
    return parse(sass)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('unit', help='a translation unit of csrc/cuda, e.g. decode_attention_mma')
    p.add_argument('--arch', type=int, default=90)
    p.add_argument('--kernel', default='', help='only kernels whose demangled name contains this')
    p.add_argument('--flags', nargs='*', default=[], help='more nvcc flags (tuning macros)')
    p.add_argument('--dump', action='store_true', help="print each kernel's main loop")
    args = p.parse_args(argv)
    kernels = [k for k in disassemble(args.unit, args.arch, args.flags) if args.kernel in k.name]
    print(f'| kernel | instructions | main loop | {" | ".join(FAMILIES)} | other loops |')
    print('| --- ' * (len(FAMILIES) + 4) + '|')
    for k in kernels:
        main_loop = k.main_loop
        m = re.search(r'(\w+(?:<[^()]*>)?)\([^()]*\)$', k.name)  # name<template args>, no namespace or args
        short = m.group(1) if m else k.name
        cells = [str(main_loop.family(f)) if main_loop else '-' for f in FAMILIES]
        others = ', '.join(str(loop.count) for loop in k.loops if loop is not main_loop)
        print(f'| {short} | {len(k.instructions)} | {main_loop.count if main_loop else "-"} | {" | ".join(cells)} '
              f'| {others or "-"} |')
        if args.dump and main_loop:
            for addr, text in k.instructions:
                if main_loop.start <= addr <= main_loop.end:
                    print(f'    {addr:#06x}  {text}')
            top = collections.Counter(main_loop.ops).most_common(12)
            print('    most frequent:', ', '.join(f'{op} {n}' for op, n in top))
    return 0


if __name__ == '__main__':
    sys.exit(main())
