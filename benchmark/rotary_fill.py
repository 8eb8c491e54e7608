"""The fused rotary + KV cache fill alone: Triton's kernel against csrc/cuda's, per KV policy.

Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128), bf16, q/k/v as views of one
qkv projection, slots in random order; a decode step's rows (batch 64-256) and prefill chunks (2k-8k
tokens). Each call is timed as a CUDA graph replay; "moved" is the bytes the call must read and write
(q, k, v in, rotated q and k out, the cache rows and their scales), its rate against the copy ceiling.

    python benchmark/rotary_fill.py
    python benchmark/rotary_fill.py --tokens 256 8192 --policy 0 8 4
"""
from __future__ import annotations

import argparse

import torch

from lmdeploy.devices import get_device
from lmdeploy.devices.cuda import compiled
from lmdeploy.devices.cuda.kernels import kv_cache

H, HKV, D, BLOCK = 32, 8, 128, 64


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--tokens', type=int, nargs='+', default=[64, 256, 2048, 8192])
    p.add_argument('--policy', type=int, nargs='+', default=[0, 8, 4])
    p.add_argument('--ceiling', type=float, default=3.0, help='copy ceiling in TB/s (H100 80GB: 3.0)')
    args = p.parse_args()
    from triton.testing import do_bench_cudagraph
    assert compiled.module() is not None, compiled.load_error()
    print(f'rotary + KV fill on {torch.cuda.get_device_name()}: {H} heads, {HKV} KV heads, head_dim {D}, bf16')
    print('| tokens | policy | kernel | us / call | moved MB | TB/s | of ceiling | vs Triton |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- |')
    for t in args.tokens:
        for policy in args.policy:
            spec = get_device('cuda').kv_cache_spec(HKV, D, BLOCK, torch.bfloat16, policy)  # the engine's layout
            nblocks = -(-t // BLOCK) + 1
            cache = spec.allocate(nblocks, 'cuda')
            qkv = torch.randn(t, (H + 2 * HKV) * D, dtype=torch.bfloat16, device='cuda')
            q, k, v = (x.view(t, -1, D) for x in qkv.split([H * D, HKV * D, HKV * D], dim=-1))
            angles = torch.rand(t, D // 2, device='cuda') * 6.3
            cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
            slots = torch.randperm(nblocks * BLOCK, device='cuda')[:t]
            row = spec.bytes_per_block / BLOCK  # one token's cache bytes
            moved = t * ((H + 2 * HKV) * D * 2 + (H + HKV) * D * 2 + row + 2 * D * 4)
            torch.cuda.synchronize()
            calls = {
                'triton': lambda: kv_cache.rotary_fill_kv(q, k, v, cos, sin, cache.k, cache.v, slots,
                                                          cache.k_scale_zero, cache.v_scale_zero),
                'compiled': lambda: compiled.rotary_fill_kv(q, k, v, cos, sin, cache, slots),
            }
            base = None
            for name, fn in calls.items():
                us = do_bench_cudagraph(fn, rep=50) * 1e3
                base = base or us
                rate = moved / us / 1e6
                print(f'| {t} | {policy} | {name} | {us:.1f} | {moved / 1e6:.2f} | {rate:.2f} | '
                      f'{rate / args.ceiling:.0%} | {base / us:.2f}x |', flush=True)


if __name__ == '__main__':
    main()
