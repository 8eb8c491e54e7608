"""The Triton decode-attention kernel's tile choice at a model family's attention shape.

    python benchmark/decode_tiles.py --heads 16 --kv-heads 8 --head-dim 256 --softcap 50 --batch 205 --median 450

Every (context tokens a tile, tiles in flight, warps) is checked against the tiles that
``attention.decode_tiles`` picks, then timed as CUDA graph replays; the rate is the KV bytes read over the
time. ``decode_tiles`` was tuned at head_dim 128: at 256 a tile holds twice the bytes, so the shared memory
that a choice assumes, and the registers of its accumulator, differ.
"""
import argparse
import math
import random

import torch

from bench_utils import rel_err
from decode_attn_sweep import make_batch
from lmdeploy.devices.cuda.kernels import attention


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--heads', type=int, default=16)
    p.add_argument('--kv-heads', type=int, default=8)
    p.add_argument('--head-dim', type=int, default=256)
    p.add_argument('--softcap', type=float, default=None)
    p.add_argument('--window', type=int, default=None)
    p.add_argument('--batch', type=int, nargs='+', default=[205])
    p.add_argument('--median', type=int, default=450)
    p.add_argument('--sigma', type=float, default=0.6)
    p.add_argument('--block-size', type=int, default=64)
    args = p.parse_args()
    from triton.testing import do_bench_cudagraph
    d = args.head_dim
    scale = d**-0.5
    for batch in args.batch:
        rng = random.Random(1)
        lengths = [min(4000, max(8, int(rng.lognormvariate(math.log(args.median), args.sigma)))) for _ in range(batch)]
        q, kc, vc, tables, lens, order = make_batch(batch, lengths, args.heads, args.kv_heads, d, args.block_size,
                                                    'cuda', torch.bfloat16)
        gb = sum(lengths) * args.kv_heads * d * 2 * 2 / 1e9
        kw = dict(sliding_window=args.window, logit_softcap=args.softcap)
        picked = attention.decode_tiles(attention.shared_memory(q.device), batch, 0, d)

        def call(tiles=None):
            return attention.paged_decode_attention(q, kc, vc, tables, lens, scale, max(lengths), 132, order,
                                                    tiles=tiles, **kw)

        want = call()
        base = 1e3 * do_bench_cudagraph(call)
        print(f'batch {batch}, h {args.heads}/{args.kv_heads}, d {d}, softcap {args.softcap}: '
              f'{gb * 1e3:.0f} MB of KV; decode_tiles {picked}: {base:6.1f} us {gb / base * 1e3:.2f} TB/s',
              flush=True)
        results = []
        for block_n in (16, 32, 64, 128):
            for stages in (1, 2, 3):
                for warps in (2, 4, 8):
                    tiles = (block_n, stages, warps)
                    try:
                        got = call(tiles)
                        torch.cuda.synchronize()
                    except Exception as e:  # out of shared memory or registers
                        print(f'  {tiles}: {type(e).__name__} {str(e)[:80]}')
                        continue
                    err = rel_err(got, want)
                    if not err < 1e-2:
                        print(f'  {tiles}: WRONG ({err:.3g})')
                        continue
                    results.append((1e3 * do_bench_cudagraph(lambda: call(tiles)), tiles))
        results.sort()
        for us, tiles in results[:8]:
            print(f'  tiles {tiles}: {us:6.1f} us {gb / us * 1e3:.2f} TB/s ({base / us:.2f}x)', flush=True)


if __name__ == '__main__':
    main()
