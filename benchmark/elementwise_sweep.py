"""silu_and_mul and RMSNorm (residual fused) at a prefill step's and a decode step's rows: tile widths
and warps against the ones in use.

Both only stream memory, so the figure is the bytes they move over their time. Each configuration is
checked against the kernel in use before it is timed: silu_and_mul to the bit, RMSNorm to rounding (its
sum of squares is reduced in another order with other warp counts).

    python benchmark/elementwise_sweep.py --rows 2890,256
"""
from __future__ import annotations

import argparse
import itertools

import torch

from bench_utils import rel_err, us_per_weight
from lmdeploy.devices.cuda.kernels import activation, norm, pdl


def silu(x, block, warps):
    n = x.shape[1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    activation._silu_and_mul_kernel[(x.shape[0], -(-n // block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block,
                                                                  num_warps=warps, PDL=pdl.ON, **pdl.LAUNCH)
    return out


def rms(x, res, w, warps):
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    n = x.shape[1]
    norm._rms_norm_kernel[(x.shape[0], )](x, res, w, out, res_out, x.stride(0), res.stride(0), out.stride(0),
                                          res_out.stride(0), n, 1e-5, HAS_RES=True, BLOCK=n, num_warps=warps,
                                          PDL=pdl.ON, **pdl.LAUNCH)
    return out, res_out


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--rows', default='2890,256')
    p.add_argument('--hidden', type=int, default=4096)
    p.add_argument('--intermediate', type=int, default=14336)
    args = p.parse_args()
    dt = torch.bfloat16
    for rows in map(int, args.rows.split(',')):
        # several inputs, walked in turn, so that L2 holds none of them (as in a step)
        xs = [torch.randn(rows, 2 * args.intermediate, device='cuda', dtype=dt) for _ in range(4)]
        want = activation.silu_and_mul(xs[0])
        moved = 3 * rows * args.intermediate * 2
        for block, warps in itertools.product((512, 1024, 2048, 4096, 8192), (2, 4, 8, 16)):
            if block // (32 * warps) < 1:
                continue
            assert torch.equal(silu(xs[0], block, warps), want)
            us = us_per_weight(lambda x: silu(x, block, warps), xs)
            print(f'silu_and_mul rows={rows} block={block:5d} warps={warps:2d}: {us:7.1f} us, '
                  f'{moved / us / 1e6:.2f} TB/s' + ('  (in use)' if (block, warps) == (1024, 4) else ''), flush=True)
        hs = [torch.randn(rows, args.hidden, device='cuda', dtype=dt) for _ in range(16)]
        pairs = list(zip(hs[::2], hs[1::2]))  # (x, residual)
        w = 1 + 0.1 * torch.randn(args.hidden, device='cuda', dtype=dt)
        want = norm.rms_norm(hs[0], w, 1e-5, hs[1])
        moved = 4 * rows * args.hidden * 2
        for warps in (1, 2, 4, 8, 16, 32):
            got = rms(hs[0], hs[1], w, warps)
            assert torch.equal(got[1], want[1]) and rel_err(got[0], want[0]) < 1e-2
            us = us_per_weight(lambda pair: rms(*pair, w, warps), pairs)
            print(f'rms_norm+residual rows={rows} warps={warps:2d}: {us:7.1f} us, {moved / us / 1e6:.2f} TB/s'
                  + ('  (in use)' if warps == 4 else ''), flush=True)


if __name__ == '__main__':
    main()
