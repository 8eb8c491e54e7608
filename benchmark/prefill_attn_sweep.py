"""Prefill attention at the throughput workload's refill step: tile sizes,
warps and pipeline depths against the ones in use.

A refill step prefills ~20 prompts of lognormal length (median 150, sigma
0.9: ~4,500 tokens), each attending to itself causally through the paged
cache. Each configuration is checked against the one in use, then timed as
CUDA graph replays.

    python benchmark/prefill_attn_sweep.py [--tokens 4500]
"""
from __future__ import annotations

import argparse
import itertools
import math
import random

import torch

from bench_utils import rel_err
from decode_attn_sweep import make_batch
from lmdeploy.devices.cuda.kernels import attention


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--tokens', type=int, default=4500)
    p.add_argument('--top', type=int, default=6)
    args = p.parse_args()
    from triton.testing import do_bench_cudagraph
    rng = random.Random(0)
    lengths = []
    while sum(lengths) < args.tokens:
        lengths.append(min(2000, max(4, int(rng.lognormvariate(math.log(150), 0.9)))))
    b, h, hkv, d = len(lengths), 32, 8, 128
    _, kc, vc, tables, lens, _ = make_batch(b, lengths, h, hkv, d, 64, 'cuda', torch.bfloat16)
    q = torch.randn(sum(lengths), h, d, device='cuda', dtype=torch.bfloat16)
    q_lens = lens.clone()
    starts = torch.cumsum(q_lens, 0) - q_lens

    def run(tiles=None):
        return attention.paged_prefill_attention(q, kc, vc, tables, starts, q_lens, lens, d**-0.5, max(lengths),
                                                 max(lengths), tiles)

    want = run()
    flops = sum(4 * n * (n + 1) / 2 * h * d for n in lengths)
    base = 1e3 * do_bench_cudagraph(run)
    print(f'{b} prompts, {sum(lengths)} tokens (longest {max(lengths)}): in use '
          f'{attention.prefill_tiles(d)} {base:7.1f} us, {flops / base / 1e6:.0f} TFLOP/s', flush=True)
    results = []
    for tiles in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        try:
            got = run(tiles)
        except Exception as e:  # out of resources: skip
            print(f'  {tiles}: {type(e).__name__}')
            continue
        err = rel_err(got, want)
        if not err < 1e-2:
            print(f'  {tiles}: WRONG ({err:.3g})')
            continue
        results.append((1e3 * do_bench_cudagraph(lambda tiles=tiles: run(tiles)), tiles))
    results.sort()
    for us, tiles in results[:args.top]:
        print(f'  {tiles}: {us:7.1f} us, {flops / us / 1e6:.0f} TFLOP/s ({base / us:.2f}x)', flush=True)


if __name__ == '__main__':
    main()
