"""Decode-step GEMMs: cuBLAS against Triton tile and split-K configurations.

A decode step of ~250 sequences spends over half its time in the four
linear layers of each block, at M = 256 rows, where cuBLAS reaches ~70% of
the weight-streaming bound on an H100. This sweeps a plain tiled Triton GEMM
(consecutive programs share a weight tile through L2) with the output split
along K (fp32 atomics into a zeroed buffer, then one cast) over tile sizes,
pipeline depths and split counts, checks each against torch, and prints the
best configurations per shape next to cuBLAS, all timed as CUDA graph
replays (as the engine runs them).

    python benchmark/gemm_sweep.py                      # Llama-3-8B shapes, M = 256
    python benchmark/gemm_sweep.py --m 248 --top 5
    python benchmark/gemm_sweep.py --others --no-sweep  # cuBLAS, swapped, cuBLASLt, torch.compile max-autotune

``--check`` runs only the correctness check, on small shapes (works in the
Triton interpreter: TRITON_INTERPRET=1 on a CPU-only machine).
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch
import triton
import triton.language as tl

from bench_utils import SHAPES, rel_err


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """out[M, N] (+)= x[M, K] @ w[N, K]^T over this program's share of K.
    The M tiles of one weight tile are consecutive programs, so the weight
    is read from memory once and the second read hits L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = tl.program_id(1) * per_split
    k_last = tl.minimum(k_first + per_split, k_tiles)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(k_first, k_last):
        k = kt * BLOCK_K + offs_k
        k_mask = k < K
        a = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem='relaxed')


def triton_linear(x, w, cfg, partial=None):
    """x @ w.T with one configuration (bm, bn, bk, stages, warps, split_k);
    ``partial``: a float32 [M, N] buffer for split-K (zeroed here)."""
    bm, bn, bk, stages, warps, split = cfg
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    target = out
    if split > 1:
        target = partial if partial is not None else torch.empty((m, n), dtype=torch.float32, device=x.device)
        target.zero_()
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    _gemm_kernel[grid](x, w, target, m, n, k, x.stride(0), w.stride(0), target.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                       BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)
    if split > 1:
        out.copy_(target)
    return out


def configs(smem_bytes: int):
    """Tile shapes whose pipeline fits the shared memory (2-byte elements)."""
    for bm, bn, bk, stages, split in itertools.product((64, 128, 256), (64, 128, 256), (64, 128), (3, 4), (1, 2, 4)):
        if (bm + bn) * bk * 2 * stages > smem_bytes - 8 * 1024 or bm * bn > 128 * 256:
            continue
        yield bm, bn, bk, stages, 8 if bm * bn >= 128 * 128 else 4, split  # warps: the accumulator's registers


def check(device, dtype, shapes, cfgs):
    for (m, n, k), cfg in itertools.product(shapes, cfgs):
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
        got = triton_linear(x, w, cfg).float()
        want = x.float() @ w.float().T
        err = rel_err(got, want)
        assert err < 2e-2, (m, n, k, cfg, err)
    return True


def other_gemms(x, w, want, compile_too=True):
    """(label, microseconds or None) for the swapped product (w @ x^T, the
    output transposed: cuBLAS then sees N as its rows), cuBLASLt and
    torch.compile's max-autotune templates on the same operands, each
    checked first."""
    from triton.testing import do_bench_cudagraph

    def checked(label, fn):
        if not rel_err(fn().float(), want) < 2e-2:
            return f'{label}: WRONG RESULT', None
        return label, 1e3 * do_bench_cudagraph(fn)

    out = [checked('swapped w @ x^T', lambda: torch.mm(w, x.t()).t())]
    previous = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library('cublaslt')
        out.append(checked('cuBLASLt', lambda: torch.nn.functional.linear(x, w)))
    except Exception as e:  # not available in this build
        out.append((f'cuBLASLt: {type(e).__name__}: {e}', None))
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
    if not compile_too:
        return out
    try:
        compiled = torch.compile(torch.nn.functional.linear, mode='max-autotune-no-cudagraphs', dynamic=False)
        out.append(checked('torch.compile max-autotune', lambda: compiled(x, w)))
    except Exception as e:  # inductor missing or failing here
        out.append((f'torch.compile: {type(e).__name__}: {str(e)[:200]}', None))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--m', type=int, default=256)
    p.add_argument('--top', type=int, default=3)
    p.add_argument('--shapes', default=','.join(name for name, _, _ in SHAPES), help='which of ' +
                   ', '.join(name for name, _, _ in SHAPES))
    p.add_argument('--check', action='store_true', help='correctness only, small shapes')
    p.add_argument('--others', action='store_true',
                   help="also time cuBLASLt (torch's preferred BLAS library switched) and torch.compile's "
                   'max-autotune GEMM templates (minutes of autotuning per shape)')
    p.add_argument('--no-compile', action='store_true', help='with --others: leave torch.compile out')
    p.add_argument('--no-sweep', action='store_true', help='skip the Triton configurations')
    args = p.parse_args()
    interp = os.environ.get('TRITON_INTERPRET') == '1'
    device = 'cuda' if torch.cuda.is_available() and not interp else 'cpu'
    if args.check:
        cfgs = [(16, 32, 32, 2, 4, 1), (32, 16, 32, 2, 4, 2), (16, 16, 16, 2, 4, 4)]
        dtype = torch.float32 if device == 'cpu' else torch.bfloat16
        check(device, dtype, [(5, 40, 100), (33, 17, 64)], cfgs)
        print('ok')
        return
    from triton.testing import do_bench_cudagraph
    smem = triton.runtime.driver.active.utils.get_device_properties(0)['max_shared_mem']
    cfgs = list(configs(smem))
    print(f'{torch.cuda.get_device_name()}, M={args.m}, {len(cfgs)} configurations')
    for name, n, k in [shape for shape in SHAPES if shape[0] in args.shapes.split(',')]:
        x = torch.randn(args.m, k, device='cuda', dtype=torch.bfloat16)
        w = torch.randn(n, k, device='cuda', dtype=torch.bfloat16) / k ** 0.5
        partial = torch.empty((args.m, n), dtype=torch.float32, device='cuda')
        want = torch.nn.functional.linear(x, w).float()

        def rate(us):
            return f'{us:7.1f} us {n * k * 2 / us / 1e6:5.2f} TB/s {2 * args.m * n * k / us / 1e6:4.0f} TFLOP/s'

        base = 1e3 * do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w))
        print(f'{name:8s} N={n} K={k}: cuBLAS {rate(base)}', flush=True)
        if args.others:
            for label, us in other_gemms(x, w, want, not args.no_compile):
                print(f'          {label}: {rate(us)} ({base / us:.2f}x cuBLAS)' if us else f'          {label}',
                      flush=True)
        results = []
        for cfg in [] if args.no_sweep else cfgs:
            try:
                got = triton_linear(x, w, cfg, partial).float()
            except Exception as e:  # out of resources for this GPU: skip the configuration
                print(f'  {name} {cfg}: {type(e).__name__}')
                continue
            if rel_err(got, want) > 2e-2:
                print(f'  {name} {cfg}: WRONG RESULT')
                continue
            results.append((1e3 * do_bench_cudagraph(lambda: triton_linear(x, w, cfg, partial)), cfg))
        results.sort()
        for us, cfg in results[:args.top]:
            print(f'          triton {cfg}: {rate(us)} ({base / us:.2f}x cuBLAS)')


if __name__ == '__main__':
    main()
