"""Every algorithm cuBLASLt's heuristic offers for the decode and prefill
GEMMs, timed against the one torch gets.

torch's ``F.linear`` takes cuBLASLt's first suggestion. For the skinny
decode GEMMs (M = 256, where the weight-streaming and compute bounds meet)
the first suggestion is not always the fastest; this asks for up to
``--algos`` of them through the library's C API (ctypes: nothing to
compile), checks each against torch, and times each as CUDA graph replays
over a model's worth of weights (so L2 holds none of them), as the engine
runs a decode step.

    python benchmark/cublaslt_algos.py --m 256,4800 [--algos 32]

out[M, N] = x[M, K] @ w[N, K]^T is, column-major, out^T = op_T(w) @ x^T:
A = w (K x N, ld K, transposed), B = x (K x M, ld K), D = out (N x M, ld N).
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys

import torch

from bench_utils import SHAPES, rel_err, us_per_weight, weight_copies

CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 68, 0, 2, 14
DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE_BYTES, OP_N, OP_T = 3, 4, 1, 0, 1
WORKSPACE = 32 << 20


class Algo(ctypes.Structure):
    _fields_ = [('data', ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t (96 bytes)."""
    _fields_ = [('algo', Algo), ('workspace_size', ctypes.c_size_t), ('state', ctypes.c_int),
                ('waves', ctypes.c_float), ('reserved', ctypes.c_int * 4)]


def load_library():
    """The libcublasLt that torch already uses (loaded by a first GEMM)."""
    for name in ('libcublasLt.so.13', 'libcublasLt.so.12', 'libcublasLt.so'):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    for path in sys.path:
        for lib in glob.glob(os.path.join(path, 'nvidia', '*', 'lib', 'libcublasLt.so*')):
            return ctypes.CDLL(lib)
    raise OSError('libcublasLt not found')


class LtGemm:
    """out = x @ w^T for one (M, N, K, dtype) through a chosen algorithm."""

    def __init__(self, lib, m, n, k, dtype):
        self.lib, self.m, self.n = lib, m, n
        dt = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F}[dtype]
        self.handle, self.desc, self.pref = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._ok(lib.cublasLtCreate(ctypes.byref(self.handle)))
        self._ok(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F))
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            value = ctypes.c_int32(op)
            self._ok(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4))
        self.a, self.b, self.d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for layout, rows, cols, ld in ((self.a, k, n, k), (self.b, k, m, k), (self.d, n, m, n)):
            self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dt, ctypes.c_uint64(rows),
                                                    ctypes.c_uint64(cols), ctypes.c_int64(ld)))
        self._ok(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)))
        size = ctypes.c_uint64(WORKSPACE)
        self._ok(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size),
                                                          8))
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device='cuda')
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _ok(status):
        if status != 0:
            raise RuntimeError(f'cuBLASLt status {status}')

    def heuristics(self, count):
        results = (Heuristic * count)()
        returned = ctypes.c_int(0)
        self._ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d,
                                                         self.pref, count, results, ctypes.byref(returned)))
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def __call__(self, x, w, out, heuristic):
        self._ok(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta), ctypes.c_void_p(out.data_ptr()), self.d,
            ctypes.c_void_p(out.data_ptr()), self.d, ctypes.byref(heuristic.algo),
            ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(WORKSPACE),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)))
        return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--m', default='256', help='comma-separated row counts')
    p.add_argument('--shapes', default=','.join(name for name, _, _ in SHAPES))
    p.add_argument('--algos', type=int, default=32, help='how many suggestions to ask for')
    p.add_argument('--top', type=int, default=3)
    args = p.parse_args()
    torch.nn.functional.linear(torch.ones(8, 8, device='cuda', dtype=torch.bfloat16),
                               torch.ones(8, 8, device='cuda', dtype=torch.bfloat16))  # loads cuBLASLt
    lib = load_library()
    print(f'{torch.cuda.get_device_name()}, cuBLASLt {lib.cublasLtGetVersion()}')
    for m in (int(v) for v in args.m.split(',')):
        for name, n, k in [s for s in SHAPES if s[0] in args.shapes.split(',')]:
            x = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
            ws = weight_copies(n, k)
            out = torch.empty(m, n, device='cuda', dtype=torch.bfloat16)
            want = torch.nn.functional.linear(x, ws[0])
            base = us_per_weight(lambda w: torch.nn.functional.linear(x, w), ws)
            gemm = LtGemm(lib, m, n, k, torch.bfloat16)
            found = gemm.heuristics(args.algos)
            print(f'M={m} {name} N={n} K={k}: torch {base:7.1f} us, {2 * m * n * k / base / 1e6:4.0f} TFLOP/s; '
                  f'{len(found)} suggestions', flush=True)
            timed = []
            for i, h in enumerate(found):
                try:
                    got = gemm(x, ws[0], out, h)
                except RuntimeError as e:
                    print(f'  suggestion {i}: {e}')
                    continue
                if not rel_err(got, want) < 1e-2:
                    print(f'  suggestion {i}: WRONG RESULT')
                    continue
                us = us_per_weight(lambda w, h=h: gemm(x, w, out, h), ws)
                timed.append((us, i, h.waves))
            for us, i, waves in sorted(timed)[:args.top]:
                print(f'  suggestion {i:2d} (waves {waves:.2f}): {us:7.1f} us ({base / us:.2f}x torch)', flush=True)


if __name__ == '__main__':
    main()
