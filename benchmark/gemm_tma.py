"""Decode-step GEMMs through the tensor copy engine (TMA) against cuBLAS.

A persistent Triton GEMM whose tiles arrive by TMA (Hopper), with the gated
MLP's variant that computes silu(x W_gate^T) * (x W_up^T) in one pass (no
separate activation kernel, the [M, 2I] projection never written). Each
configuration is checked against torch first, then timed as CUDA graph
replays over a model's worth of weights (so L2 holds none of them), as the
engine runs a decode step.

    python benchmark/gemm_tma.py                 # Llama-3-8B shapes, M = 256
    python benchmark/gemm_tma.py --m 248
    TRITON_INTERPRET=1 python benchmark/gemm_tma.py --check   # correctness on small shapes, CPU
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench_utils import SHAPES, rel_err, us_per_weight, weight_copies


@triton.jit
def _tma_gemm(a_desc, w_desc, c_desc, M, N, K, NUM_PROGS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """c = a @ w^T, or (GATED) c = silu(a @ w[:N]^T) * (a @ w[N:]^T) for w
    holding 2N rows. Programs walk the tiles with the M index fastest, so
    the programs sharing one weight tile run side by side and the second
    read of it hits L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_tiles = num_m * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(pid, num_tiles, NUM_PROGS, flatten=True):
        m0 = (tile % num_m) * BLOCK_M
        n0 = (tile // num_m) * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kt in range(k_tiles):
            a = a_desc.load([m0, kt * BLOCK_K])
            acc = tl.dot(a, w_desc.load([n0, kt * BLOCK_K]).T, acc)
            if GATED:
                acc_up = tl.dot(a, w_desc.load([N + n0, kt * BLOCK_K]).T, acc_up)
        dt = c_desc.dtype
        if GATED:  # rounded as the unfused ops round: projections, then silu, then the product
            gate = acc.to(dt).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            c_desc.store([m0, n0], (act * acc_up.to(dt).to(tl.float32)).to(dt))
        else:
            c_desc.store([m0, n0], acc.to(dt))


def tma_linear(x, w, cfg, num_sms, gated=False):
    bm, bn, bk, stages, warps, persistent = cfg
    m, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    progs = min(num_sms, tiles) if persistent else tiles
    _tma_gemm[(progs, )](TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
                         TensorDescriptor.from_tensor(out, [bm, bn]), m, n, k, NUM_PROGS=progs, BLOCK_M=bm,
                         BLOCK_N=bn, BLOCK_K=bk, GATED=gated, num_warps=warps, num_stages=stages)
    return out


def reference(x, w, gated):
    y = torch.nn.functional.linear(x, w)
    if gated:
        g, u = y.chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u).to(x.dtype)
    return y


def configs(gated: bool):
    """Tiles whose accumulators fit the registers of 8 warps (the gated
    kernel holds two) and whose pipeline fits the shared memory."""
    for bm, bn, bk, stages, persistent in itertools.product((128, 256), (64, 128, 256), (64, ), (3, 4),
                                                            (True, False)):
        if bm * bn * (2 if gated else 1) > 128 * 256 or (bm + bn * (2 if gated else 1)) * bk * 2 * stages > 200 * 1024:
            continue
        yield bm, bn, bk, stages, 8 if bm * bn >= 128 * 128 else 4, persistent


def check(device, dtype) -> bool:
    """Both kernels against torch on small shapes that leave partial tiles
    in M, N and K (persistent and one-tile-a-program grids)."""
    for (m, n, k), gated in itertools.product([(20, 96, 80), (64, 64, 128)], (False, True)):
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(2 * n if gated else n, k, device=device, dtype=dtype) / k**0.5
        for cfg in [(16, 32, 32, 2, 4, True), (32, 16, 16, 2, 4, False)]:
            got = tma_linear(x, w, cfg, num_sms=3, gated=gated)
            err = rel_err(got, reference(x.float(), w.float(), gated))
            assert err < 1e-2, (m, n, k, gated, cfg, err)
    return True


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--m', type=int, default=256)
    p.add_argument('--top', type=int, default=3)
    p.add_argument('--check', action='store_true', help='correctness only, small shapes (works interpreted)')
    args = p.parse_args()
    if args.check:
        check('cpu' if os.environ.get('TRITON_INTERPRET') == '1' else 'cuda', torch.float16)
        print('ok')
        return
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f'{torch.cuda.get_device_name()}, M={args.m}')
    block = SHAPES[:4]  # the logits GEMM is not swept here
    for (name, n, k), gated in [(s, False) for s in block] + [(block[2], True)]:
        x = torch.randn(args.m, k, device='cuda', dtype=torch.bfloat16)
        ws = weight_copies(n, k)
        want = reference(x, ws[0], gated)
        label = name + ('+silu' if gated else '')
        flops = 2 * args.m * n * k

        def rate(us):
            return f'{us:7.1f} us {n * k * 2 / us / 1e6:5.2f} TB/s {flops / us / 1e6:4.0f} TFLOP/s'

        if gated:
            from lmdeploy.devices.cuda.kernels.activation import silu_and_mul
            base = us_per_weight(lambda w: silu_and_mul(torch.nn.functional.linear(x, w)), ws)
        else:
            base = us_per_weight(lambda w: torch.nn.functional.linear(x, w), ws)
        print(f'{label:12s} N={n} K={k}: cuBLAS{" + silu kernel" if gated else ""} {rate(base)}', flush=True)
        results = []
        for cfg in configs(gated):
            try:
                err = rel_err(tma_linear(x, ws[0], cfg, num_sms, gated), want)
            except Exception as e:  # out of resources on this GPU: skip the configuration
                print(f'  {cfg}: {type(e).__name__}: {str(e)[:120]}')
                continue
            if err > 2e-2:
                print(f'  {cfg}: WRONG RESULT ({err:.3g})')
                continue
            results.append((us_per_weight(lambda w, cfg=cfg: tma_linear(x, w, cfg, num_sms, gated), ws), cfg))
        results.sort()
        for us, cfg in results[:args.top]:
            print(f'          tma {cfg}: {rate(us)} ({base / us:.2f}x)', flush=True)


if __name__ == '__main__':
    main()
