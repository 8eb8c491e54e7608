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
    python benchmark/kv_quant_attn.py --layout token head  # blocks stored token- / head-major (devices/cache.py)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools

import torch

from lmdeploy.devices import get_device
from lmdeploy.devices.cuda.kernels import attention
from lmdeploy.devices.cuda.splits import num_decode_splits

H, HKV, D, BLOCK = 32, 8, 128, 64


@contextlib.contextmanager
def fixed_splits(n: int):
    """Both kernels cut every context into n slices (0: the engine's choice, splits.num_decode_splits)."""
    from lmdeploy.devices.cuda import compiled
    saved = compiled.num_decode_splits, attention.num_decode_splits
    if n:
        compiled.num_decode_splits = attention.num_decode_splits = lambda *args: n
    try:
        yield
    finally:
        compiled.num_decode_splits, attention.num_decode_splits = saved


def make(batch: int, context: int, policy: int, layout: str, seed: int = 0):
    """``layout``: ``device`` (the cuda device's spec), ``token`` or ``head`` (blocks stored so)."""
    spec = get_device('cuda').kv_cache_spec(HKV, D, BLOCK, torch.bfloat16, policy)
    if layout != 'device':
        spec = dataclasses.replace(spec, head_major=layout == 'head')
    per_seq = -(-context // BLOCK)
    gen = torch.Generator(device='cuda').manual_seed(seed)
    cache = spec.allocate(batch * per_seq, 'cuda')
    for t in cache.tensors().values():
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, device='cuda', dtype=torch.int32))
        elif t.shape[-1] == 2 and policy:  # (scale, zero)
            t[..., 0].uniform_(0.001, 0.05, generator=gen)
            t[..., 1].uniform_(-2, 0, generator=gen)
        else:
            t.normal_(generator=gen)
    tables = torch.randperm(batch * per_seq, generator=gen, device='cuda').to(torch.int32).view(batch, per_seq)
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device='cuda', generator=gen)
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
    p.add_argument('--layout', nargs='+', default=['device'], choices=['device', 'token', 'head'],
                   help='how cache blocks are stored: as the cuda device allocates them (default: head-major '
                   'when quantized), token-major [S, Hkv, ...] or head-major [Hkv, S, ...]')
    args = p.parse_args()
    from triton.testing import do_bench_cudagraph

    from lmdeploy.devices.cuda import compiled
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f'decode attention on {torch.cuda.get_device_name()}: {H} heads, {HKV} KV heads, head_dim {D}, '
          f'block {BLOCK}; copy ceiling {args.ceiling} TB/s')
    print('| batch | context | policy | layout | kernel | tiles | splits | us / call | read GB | read TB/s | '
          'of ceiling | bf16-equivalent TB/s | vs Triton, policy 0 |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |')
    for batch in args.batch:
        for context in args.context:
            base = None
            for policy, layout, tiles, splits, impl in ((p, la, t, n, i) for p in args.policy for la in args.layout
                                                        for t in args.tiles for n in args.splits for i in args.impl):
                if impl.startswith('compiled') and tiles is not None:
                    continue
                spec, cache, tables, q, lens = make(batch, context, policy, layout)
                shown_layout = 'head' if spec.head_major else 'token'
                per_token = spec.bytes_per_block / BLOCK
                read = batch * context * per_token / 1e9
                bf16 = batch * context * HKV * D * 2 * 2 / 1e9
                if impl.startswith('compiled'):
                    kernel = 'cuda_cores' if impl == 'compiled-cuda-cores' else 'auto'
                    call = functools.partial(compiled.paged_decode_attention, q, cache, tables, lens, D**-0.5,
                                             args.max_kv_len or context, num_sms, kernel=kernel)
                    assert call() is not None, 'the compiled kernel does not take these inputs'
                else:
                    call = functools.partial(attention.paged_decode_attention, q, cache.k, cache.v, tables, lens,
                                             D**-0.5, args.max_kv_len or context, num_sms,
                                             k_scale_zero=cache.k_scale_zero,
                                             v_scale_zero=cache.v_scale_zero, tiles=tiles)
                with fixed_splits(splits):
                    us = 1e3 * do_bench_cudagraph(call)
                torch.cuda.synchronize()
                base = base or (us if policy == 0 and tiles is None and not splits and impl == 'triton'
                                and not spec.head_major else None)
                rate = read / us * 1e6 / 1e3
                vs = f'{base / us:.2f}x' if base else '-'
                shown = ','.join(map(str, tiles)) if tiles else 'default'
                chosen = splits or num_decode_splits(batch, HKV, args.max_kv_len or context, num_sms)
                print(f'| {batch} | {context} | {policy} | {shown_layout} | {impl} | {shown} | {chosen} | {us:.1f} | '
                      f'{read:.3f} | {rate:.2f} | {100 * rate / args.ceiling:.0f}% | {bf16 / us * 1e6 / 1e3:.2f} | '
                      f'{vs} |', flush=True)
                del cache, tables, q, call
                torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
