"""Decode attention alone over a 16-bit, int8 and int4 KV cache: time per
call and the rate at which it reads the cache.

Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128),
block size 64, every sequence at the same context length, blocks handed out
in random order. The cache holds random codes and scales (the kernels'
answers are checked against the reference in tests/test_cuda_kernels.py);
each call is timed as a CUDA graph replay. "read" is the bytes the call must
read (codes plus each token's scale and zero), "bf16-equivalent" the bytes
a 16-bit cache of the same tokens would have needed: that rate is what a
quantized cache buys over the copy ceiling.

    python benchmark/kv_quant_attn.py                       # batch 64 128 256, contexts 1k to 8k
    python benchmark/kv_quant_attn.py --batch 128 --context 4096 --policy 0 8
    python benchmark/kv_quant_attn.py --impl triton compiled   # the Triton kernel and csrc/cuda's side by side
    python benchmark/kv_quant_attn.py --impl compiled compiled-cuda-cores  # csrc/cuda's two kernels (sm80+)
    python benchmark/kv_quant_attn.py --impl compiled --splits 0 1 2 4 8   # slices a context is cut into
    python benchmark/kv_quant_attn.py --slice-scale 0 256 512   # the fewest tokens a slice holds (splits.py)
    python benchmark/kv_quant_attn.py --layout token head  # blocks stored token- / head-major (devices/cache.py)
    python benchmark/kv_quant_attn.py --lengths varied     # lengths drawn from 1..context (or: lognormal)
    python benchmark/kv_quant_attn.py --floor              # and the fastest plain read of as many bytes (read_floor.py)
    python benchmark/kv_quant_attn.py --cold               # each call over another copy of the cache (none in L2)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools

import torch

from bench_utils import random_paged_cache
from lmdeploy.devices import get_device
from lmdeploy.devices.cuda.kernels import attention
from lmdeploy.devices.cuda.splits import min_slice_tokens, num_decode_splits

H, HKV, D, BLOCK = 32, 8, 128, 64


@contextlib.contextmanager
def slicing(n: int, scale):
    """Both kernels launch n slices of every context (0: the engine's choice, splits.num_decode_splits), of
    at least splits.min_slice_tokens tokens each with ``scale`` as its tokens per program an SM (None: the
    engine's; 0: no floor but a tile, the rule before each sequence had one)."""
    from lmdeploy.devices.cuda import compiled, splits
    saved = compiled.num_decode_splits, attention.num_decode_splits, splits.TOKENS_PER_PROGRAM_PER_SM
    if n:
        compiled.num_decode_splits = attention.num_decode_splits = lambda *args: n
    if scale is not None:
        splits.TOKENS_PER_PROGRAM_PER_SM = scale
    try:
        yield
    finally:
        compiled.num_decode_splits, attention.num_decode_splits, splits.TOKENS_PER_PROGRAM_PER_SM = saved


def make(batch: int, context: int, policy: int, layout: str, lengths: str = 'uniform', seed: int = 0):
    """``layout``: ``device`` (the cuda device's spec), ``token`` or ``head`` (blocks stored so);
    ``lengths``: every sequence at ``context`` (``uniform``), or each drawn (seeded) uniformly from 1..context
    (``varied``) or lognormal with median context / 4, clipped to it (``lognormal``: a few long ones)."""
    spec = get_device('cuda').kv_cache_spec(HKV, D, BLOCK, torch.bfloat16, policy)
    if layout != 'device':
        spec = dataclasses.replace(spec, head_major=layout == 'head')
    gen = torch.Generator(device='cuda').manual_seed(seed)
    cache, tables = random_paged_cache(spec, [context] * batch, gen)
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device='cuda', generator=gen)
    if lengths == 'varied':
        lens = torch.randint(1, context + 1, (batch, ), generator=gen, device='cuda', dtype=torch.int64)
    elif lengths == 'lognormal':
        normal = torch.randn(batch, generator=gen, device='cuda')
        lens = (context / 4 * normal.exp()).clamp(1, context).to(torch.int64)
    else:
        lens = torch.full((batch, ), context, dtype=torch.int64, device='cuda')
    # do_bench_cudagraph runs on a stream of its own, which waits for none of the above
    torch.cuda.synchronize()
    return spec, cache, tables, q, lens


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--batch', type=int, nargs='+', default=[64, 128, 256])
    p.add_argument('--context', type=int, nargs='+', default=[1024, 2048, 4096, 8192])
    p.add_argument('--policy', type=int, nargs='+', default=[0, 8, 4])
    p.add_argument('--max-kv-len', type=int, default=None,
                   help='the bound the kernels cut contexts by (default: the context, as an eager step passes; '
                        'a replayed CUDA graph passes session_len)')
    p.add_argument('--ceiling', type=float, default=3.0, help='the copy ceiling in TB/s (an H100 80GB: 3.0)')
    p.add_argument('--tiles', nargs='+', default=[None], type=lambda s: tuple(map(int, s.split(','))),
                   help='decode tiles to sweep, each "tokens,stages,warps" (default: the kernel\'s choice)')
    p.add_argument('--impl', nargs='+', default=['triton'], choices=['triton', 'compiled', 'compiled-cuda-cores'],
                   help='which kernels: Triton\'s, the compiled one (csrc/cuda; python csrc/build.py first: '
                   'tensor cores on sm80+), the compiled CUDA-core one')
    p.add_argument('--splits', type=int, nargs='+', default=[0],
                   help='slices each context is cut into, to sweep (default 0: the choice the engine makes)')
    p.add_argument('--slice-scale', type=int, nargs='+', default=[None],
                   help='splits.TOKENS_PER_PROGRAM_PER_SM values to sweep (0: slices of any length, the rule '
                   'before sequences had a floor; default: the engine\'s)')
    p.add_argument('--layout', nargs='+', default=['device'], choices=['device', 'token', 'head'],
                   help='how cache blocks are stored: as the cuda device allocates them (default: head-major '
                   'when quantized), token-major [S, Hkv, ...] or head-major [Hkv, S, ...]')
    p.add_argument('--lengths', default='uniform', choices=['uniform', 'varied', 'lognormal'],
                   help='every sequence at the context length, or each drawn from 1..context, or lognormal with '
                   'median context / 4 (clipped to it); the kernels are still told the context as the bound')
    p.add_argument('--floor', action='store_true',
                   help='also time the fastest plain read of as many bytes as each call reads (read_floor.py: '
                   'torch.sum or a swept Triton reader): what a read of that size reaches on this GPU (a kernel '
                   'launch, ramp-up and tail included)')
    p.add_argument('--cold', action='store_true',
                   help='time each call over another copy of the cache (0.4 GB of copies in all), so that no call '
                   'finds its cache in L2, as in the engine (the default re-reads one cache: caches under ~50 MB '
                   'then come partly from L2)')
    args = p.parse_args()
    from triton.testing import do_bench_cudagraph

    from lmdeploy.devices.cuda import compiled
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f'decode attention on {torch.cuda.get_device_name()}: {H} heads, {HKV} KV heads, head_dim {D}, '
          f'block {BLOCK}; copy ceiling {args.ceiling} TB/s')
    print('| batch | context | policy | layout | kernel | tiles | slices, fewest tokens | us / call | read GB | '
          'read TB/s | of ceiling | bf16-equivalent TB/s | vs Triton, policy 0 |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |')
    for batch in args.batch:
        for context in args.context:
            base = None
            floors = set()
            for policy, layout, tiles, splits, scale, impl in (
                    (p, la, t, n, sc, i) for p in args.policy for la in args.layout for t in args.tiles
                    for n in args.splits for sc in args.slice_scale for i in args.impl):
                if impl.startswith('compiled') and tiles is not None:
                    continue
                spec, cache, tables, q, lens = make(batch, context, policy, layout, args.lengths)
                copies = [(cache, tables, q)]
                shown_layout = 'head' if spec.head_major else 'token'
                per_token = spec.bytes_per_block / BLOCK
                tokens = int(lens.sum())
                read = tokens * per_token / 1e9
                bf16 = tokens * HKV * D * 2 * 2 / 1e9
                # cold: as many caches as make 0.4 GB (seeded apart), each call the next, so none is found in L2
                # (50 MB on an H100) as a replayed call over one small cache would; the engine's layers
                # stream their weights between two reads of a layer's cache
                n_copies = -(-int(0.4e9) // int(read * 1e9)) if args.cold else 1
                copies += [make(batch, context, policy, layout, args.lengths, seed=i)[1:4] for i in range(1, n_copies)]
                if args.floor and policy not in floors:
                    floors.add(policy)
                    print_floor(batch, context, policy, read, args.ceiling, n_copies)
                calls = []
                for c, t, qq in copies:
                    if impl.startswith('compiled'):
                        kernel = 'cuda_cores' if impl == 'compiled-cuda-cores' else 'auto'
                        calls.append(functools.partial(compiled.paged_decode_attention, qq, c, t, lens, D**-0.5,
                                                       args.max_kv_len or context, num_sms, kernel=kernel))
                        assert calls[-1]() is not None, 'the compiled kernel does not take these inputs'
                    else:
                        calls.append(functools.partial(attention.paged_decode_attention, qq, c.k, c.v, t, lens,
                                                       D**-0.5, args.max_kv_len or context, num_sms,
                                                       k_scale_zero=c.k_scale_zero, v_scale_zero=c.v_scale_zero,
                                                       tiles=tiles))
                with slicing(splits, scale):
                    us = 1e3 * do_bench_cudagraph(lambda calls=calls: [call() for call in calls]) / len(calls)
                    floor = min_slice_tokens(batch, HKV, num_sms)
                    chosen = splits or num_decode_splits(batch, HKV, args.max_kv_len or context, num_sms)
                torch.cuda.synchronize()
                base = base or (us if policy == 0 and tiles is None and not splits and impl == 'triton'
                                and not spec.head_major and scale is None else None)
                rate = read / us * 1e6 / 1e3
                vs = f'{base / us:.2f}x' if base else '-'
                shown = ','.join(map(str, tiles)) if tiles else 'default'
                print(f'| {batch} | {context} | {policy} | {shown_layout} | {impl} | {shown} | {chosen}, >= {floor} | '
                      f'{us:.1f} | '
                      f'{read:.3f} | {rate:.2f} | {100 * rate / args.ceiling:.0f}% | {bf16 / us * 1e6 / 1e3:.2f} | '
                      f'{vs} |', flush=True)
                del cache, tables, q, calls, copies
                torch.cuda.empty_cache()


def print_floor(batch: int, context: int, policy: int, read: float, ceiling: float, copies: int = 1):
    """A table row for the fastest plain read of ``read`` GB found by read_floor.py (torch.sum or a swept
    Triton reader), timed the same way (over ``copies`` buffers in turn)."""
    from read_floor import best_read
    us, what = best_read(int(read * 1e9) // 4096 * 4096, copies=copies)
    rate = read / us * 1e6 / 1e3
    print(f'| {batch} | {context} | {policy} | - | read floor ({what}) | - | - | {us:.1f} | {read:.3f} | '
          f'{rate:.2f} | {100 * rate / ceiling:.0f}% | - | - |', flush=True)


if __name__ == '__main__':
    main()
