"""Prefill attention at the throughput workload's refill step: tile sizes,
warps and pipeline depths against the ones in use.

A refill step prefills ~20 prompts of lognormal length (median 150, sigma
0.9: ~4,500 tokens), each attending to itself causally through the paged
cache. Each configuration is checked against the one in use, then timed as
CUDA graph replays.

    python benchmark/prefill_attn_sweep.py [--tokens 4500]
    python benchmark/prefill_attn_sweep.py --workload prefill3000 prefill3000-tail single8k
    python benchmark/prefill_attn_sweep.py --policy 4 --pack both     # an int4 cache, heads apart and packed
    python benchmark/prefill_attn_sweep.py --heads 16 8 256 --softcap 50 --tokens 2100 --pack both   # Gemma 2

The other workloads are the steps of ``gpu_suite.sh prefill`` (3,000-token
prompts in 8,192-token steps) and ``lat8k``; torch's fused attention on the
same prompts laid out densely is timed beside them as a yardstick.
"""
from __future__ import annotations

import argparse
import itertools
import math
import random

import torch

from bench_utils import random_paged_cache, rel_err
from decode_attn_sweep import make_batch
from lmdeploy.devices.cuda.kernels import attention


WORKLOADS = {
    # (context, query rows) of each sequence of one step
    'prefill3000': [(3000, 3000), (3000, 3000), (2028, 2028)],  # gpu_suite.sh prefill's step, first part
    'prefill3000-tail': [(3000, 972), (3000, 3000), (3000, 3000), (1056, 1056)],  # and one after a chunk
    'single8k': [(8000, 8000)],  # gpu_suite.sh lat8k
}


def refill_lengths(tokens: int):
    rng = random.Random(0)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(2000, max(4, int(rng.lognormvariate(math.log(150), 0.9)))))
    return [(n, n) for n in lengths]


def dense_reference(q, kc, vc, tables, shapes, h, hkv, d, backends):
    """torch's own fused attention on the same fresh prompts laid out densely (a yardstick, not the op):
    us per call for each backend that runs, None where a prompt is a chunk after context."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench_cudagraph
    if any(n != m for n, m in shapes):
        return {}
    bs = kc.shape[1]
    dense = []
    at = 0
    for i, (n, _) in enumerate(shapes):
        pages = tables[i, :-(-n // bs)].long()
        k = kc[pages].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
        v = vc[pages].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
        g = h // hkv  # K/V heads repeated: not every backend takes grouped heads
        dense.append((q[at:at + n].transpose(0, 1)[None].contiguous(), k.repeat_interleave(g, 1).contiguous(),
                      v.repeat_interleave(g, 1).contiguous()))
        at += n
    out = {}
    for name in backends:
        backend = getattr(SDPBackend, name)

        def run():
            with sdpa_kernel(backend):
                for qi, ki, vi in dense:
                    F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)

        try:
            run()
            out[name] = 1e3 * do_bench_cudagraph(run)
        except Exception as e:  # that backend does not take these shapes here
            out[name] = f'{type(e).__name__}'
    return out


def quantized_cache(kv_lens, hkv, d, policy):
    """The cuda device's int8 / int4 cache (its layout) of 64-token blocks handed out in random order, random
    codes and scales: (k, v, scale/zero keyword arguments, block tables, lengths)."""
    from lmdeploy.devices import get_device
    spec = get_device('cuda').kv_cache_spec(hkv, d, 64, torch.bfloat16, policy)
    cache, tables = random_paged_cache(spec, kv_lens)
    lens = torch.tensor(kv_lens, device='cuda')
    return cache.k, cache.v, dict(k_scale_zero=cache.k_scale_zero, v_scale_zero=cache.v_scale_zero), tables, lens


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--tokens', type=int, default=4500, help='refill workload: prompt tokens in the step')
    p.add_argument('--workload', nargs='+', default=['refill'], choices=['refill', *WORKLOADS])
    p.add_argument('--top', type=int, default=6)
    p.add_argument('--compare', default=None, help='a module (e.g. lmdeploy.devices.cuda.kernels.attention_old) '
                   'whose paged_prefill_attention to time against the one in use')
    p.add_argument('--dense', nargs='*', default=['FLASH_ATTENTION', 'CUDNN_ATTENTION'],
                   help="torch SDPA backends to time on the same prompts (fresh prompts only)")
    p.add_argument('--no-sweep', action='store_true')
    p.add_argument('--policy', type=int, default=0, choices=(0, 8, 4),
                   help='KV cache quant_policy (8 / 4: the cuda device\'s int8 / int4 cache, random codes)')
    p.add_argument('--heads', type=int, nargs=3, default=(32, 8, 128), metavar=('Q', 'KV', 'DIM'),
                   help='query heads, KV heads, head_dim (default: the Llama-3-8B shape)')
    p.add_argument('--softcap', type=float, default=None, help="attention scores' soft cap (Gemma 2: 50)")
    p.add_argument('--pack', default='no', choices=['no', 'yes', 'both'],
                   help="sweep tiles with each query head in its own programs ('no'), with a KV head's query "
                   "heads packed into one program's rows ('yes'), or both")
    args = p.parse_args()
    for w in args.workload:
        sweep(w, refill_lengths(args.tokens) if w == 'refill' else WORKLOADS[w], args)


def sweep(name, shapes, args):
    import importlib
    from triton.testing import do_bench_cudagraph
    kv_lens = [n for n, _ in shapes]
    q_lens = [m for _, m in shapes]
    b = len(shapes)
    h, hkv, d = args.heads
    scales = {}
    if args.policy:
        kc, vc, scales, tables, lens = quantized_cache(kv_lens, hkv, d, args.policy)
    else:
        _, kc, vc, tables, lens, _ = make_batch(b, kv_lens, h, hkv, d, 64, 'cuda', torch.bfloat16)
    q = torch.randn(sum(q_lens), h, d, device='cuda', dtype=torch.bfloat16)
    ql = torch.tensor(q_lens, device='cuda')
    starts = torch.cumsum(ql, 0) - ql

    def run(tiles=None, impl=attention):
        return impl.paged_prefill_attention(q, kc, vc, tables, starts, ql, lens, d**-0.5, max(q_lens),
                                            max(kv_lens), tiles, logit_softcap=args.softcap, **scales)

    want = run()
    flops = sum(4 * (m * (n - m) + m * (m + 1) / 2) * h * d for n, m in shapes)
    base = 1e3 * do_bench_cudagraph(run)
    in_use = attention.prefill_tiles(d, max(q_lens), h // hkv, args.policy)
    print(f'[{name}] {b} sequences, {sum(q_lens)} query rows, contexts {kv_lens}: in use '
          f'{in_use} {base:7.1f} us, {flops / base / 1e6:.0f} TFLOP/s', flush=True)
    if args.compare:
        other = importlib.import_module(args.compare)
        err = rel_err(run(impl=other), want)
        us = 1e3 * do_bench_cudagraph(lambda: run(impl=other))
        print(f'  {args.compare}: {us:7.1f} us, {flops / us / 1e6:.0f} TFLOP/s (in use: {us / base:.2f}x its speed; '
              f'rel err {err:.2g})', flush=True)
    for backend, us in dense_reference(q, kc, vc, tables, shapes, h, hkv, d,
                                       [] if args.policy or args.softcap else args.dense).items():
        print(f'  torch SDPA {backend} (dense): ' +
              (f'{us:7.1f} us, {flops / us / 1e6:.0f} TFLOP/s' if isinstance(us, float) else us), flush=True)
    if args.no_sweep:
        return
    results = []
    configs = []
    rows = (32, 64, 128) if d > 128 else (64, 128)  # wide heads: a 32-row tile is the one in use
    if args.pack in ('no', 'both'):
        configs += itertools.product(rows, (32, 64, 128), (4, 8), (2, 3, 4), (False, ))
    if args.pack in ('yes', 'both'):
        configs += itertools.product(rows, (32, 64, 128), (4, 8), (2, 3), (True, ))
    for tiles in configs:
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
