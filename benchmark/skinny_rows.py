"""The streaming GEMM kernel (kernels/linear.py) against cuBLAS at serving batch sizes.

A serving load runs decode steps of 16-128 rows, where a linear layer should
still cost one read of its weight; cuBLAS's step time grows with the rows
there (H100, decode step at 16 rows 6.8 ms, 64 rows 8.2, 128 rows 9.8). This
times the skinny kernel with BLOCK_M rows a tile against ``F.linear`` for each
Llama-3-8B shape, as CUDA graph replays over a model's worth of weights.

    python benchmark/skinny_rows.py --m 16 32 64 128
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton

from bench_utils import SHAPES, rel_err, us_per_weight, weight_copies
from lmdeploy.devices.cuda.kernels import linear, pdl


def skinny(x, w, block_n, block_k, warps, stages):
    """The kernel with every row in one tile (BLOCK_M: the rows rounded up to a power of two, 16 at least)."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    linear._skinny_kernel[(triton.cdiv(n, block_n), )](
        x, w, x, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), HAS_BIAS=False,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages, PDL=pdl.ON, **pdl.LAUNCH)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--m', type=int, nargs='+', default=[16, 32, 64, 128])
    args = p.parse_args()
    print(f"{'shape':8s} {'M':>4s} {'cuBLAS us':>10s} {'best skinny us':>15s}  (BLOCK_N, BLOCK_K, warps, stages)")
    total = {}
    for name, n, k in SHAPES[:4]:
        ws = weight_copies(n, k)
        for m in args.m:
            x = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            base = us_per_weight(lambda w: F.linear(x, w), ws)
            best = (float('inf'), None)
            for bn, bk, warps, stages in itertools.product((64, 128), (128, 256), (4, 8), (3,)):
                cfg = (bn, bk, warps, stages)
                try:
                    err = rel_err(skinny(x, ws[0], *cfg), ref)
                    if err > 1e-2:
                        print(f'  {name} M={m} {cfg} wrong: {err:.3g}')
                        continue
                    t = us_per_weight(lambda w: skinny(x, w, *cfg), ws)
                except Exception:  # e.g. out of shared memory
                    continue
                best = min(best, (t, cfg))
            total.setdefault(m, [0.0, 0.0])
            total[m][0] += base
            total[m][1] += min(base, best[0])
            print(f'{name:8s} {m:4d} {base:10.1f} {best[0]:15.1f}  {best[1]}', flush=True)
    for m, (base, best) in total.items():
        print(f'M={m:4d}: a block of four GEMMs {base:.1f} us with cuBLAS, {best:.1f} with the best of both '
              f'(x32 layers: {32 * (base - best) / 1e3:.2f} ms a step saved)')


if __name__ == '__main__':
    main()
