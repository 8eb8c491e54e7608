"""W4A16 GEMM with the weight as wgmma's register operand: y = x W^T from the packed int4 layout of
kernels/w4a16.py (int32 [K/8, N], nibble j of [r, n] holding W[n, 8r + j]), without that module's round trip
of the dequantized tile through shared memory.

Why: Triton feeds a tile computed in registers to Hopper's wgmma only if the ops between its load and the dot
are elementwise and keep the element width (Triton's OptimizeDotOperands hoists the layout conversion to the
load then: the *packed* tile goes through shared memory, 4x fewer bytes, and the unpacking runs in the
operand's register layout). The fused tiles of kernels/w4a16.py break both rules (a reshape that spreads an
int32's 8 nibbles over 8 rows; int32 to 16-bit), so their dequantized tile is stored to shared memory and read
back (read off their sm90 IR, session 49, compiled here by Triton 3.6, the GPU machine's, and 3.9 alike).

How: each int32 is read as two int16 halves (h = 0: inputs 8r..8r+3, h = 1: 8r+4..8r+7), and nibble j of
half h over a tile's packed rows r is a *plane*: W[n, 8r + 4h + j] for r in the tile, an elementwise function
of the loaded int16 tile (shift, mask, or-ing into a 16-bit float's mantissa: MAGIC of kernels/w4a16.py). Each
of the 8 planes is one product of K = BLOCK_K / 8 with the matching inputs of x, which :func:`permute_input`
lays out plane by plane beforehand (one pass over x, small next to the weight at the row counts this is for).
Compiled for sm90 (Triton 3.6 and 3.9), only the packed int16 tile goes through shared memory, loaded from there in
the operand's layout, and the 8 wgmma take the unpacked planes from registers. Its packed loads are not copied
ahead by the pipeliner (2-byte pieces); a layout of the halves side by side along N would be, but then the
tile's 4 uses per half keep Triton from hoisting the conversion (tried: the dequantized planes went through
shared memory again).

BLOCK_K is PLANE_K (128 inputs: 8 planes of 16, wgmma's K for 16-bit operands); groups are a multiple of 8
inputs (an int32's 8 share one), in order (no g_idx). The operands are swapped (out^T = W x^T, as
kernels/w4a16.py's swapped tile) so that the weight is the left operand, the one wgmma takes from registers.
Not yet timed on a GPU: benchmark/w4a16_gemm.py --gemm-sweep times it; kernels/w4a16.py's table does not use
it yet.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .w4a16 import MAGIC_OF, Config, _tile, add_splits, split_k

PLANE_K = 128  # inputs per step: 8 planes of 16 (16 packed rows)


def permute_input(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, K'] (K' = K rounded up to PLANE_K, zeros past K): in each block of PLANE_K inputs, the
    16 inputs of plane 4h + j (inputs 8r + 4h + j, r = 0..15) side by side, planes in order."""
    m, k = x.shape
    kp = triton.cdiv(k, PLANE_K) * PLANE_K
    if kp != k:
        x = F.pad(x, (0, kp - k))
    return x.reshape(m, kp // PLANE_K, PLANE_K // 8, 8).transpose(2, 3).reshape(m, kp)


@triton.jit
def _w4a16_planes_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_om,
                         stride_os, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, MAGIC: tl.constexpr,
                         MAGIC_BASE: tl.constexpr, PRECISION: tl.constexpr):
    """out^T[tile] over K range [pid_k K_SPLIT, (pid_k + 1) K_SPLIT) (K_SPLIT a multiple of PLANE_K), x
    permuted by :func:`permute_input` (stride_xm its row stride). ``MAGIC`` 0: the nibbles converted to x's
    dtype (float32 runs, the interpreter), else or-ed into MAGIC_BASE's mantissa."""
    PLANE: tl.constexpr = 16  # packed rows of a step: one plane's inputs
    offs_m, offs_n, rows_m, m_mask, n_mask, k_start, k_end = _tile(M, N, K, K_SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
    dt = x_ptr.dtype.element_ty
    qw16 = qw_ptr.to(tl.pointer_type(tl.int16))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, 8 * PLANE):
        offs_r = k0 // 8 + tl.arange(0, PLANE)  # packed rows
        r_mask = offs_r < (K // 8)
        if GROUP % (8 * PLANE) == 0:  # the step in one group: one row of scales and zeros
            sz = (k0 // GROUP) * N + offs_n[:, None]
            sz_mask = n_mask[:, None]
        else:
            sz = (offs_r[None, :] * 8 // GROUP).to(tl.int64) * N + offs_n[:, None]
            sz_mask = n_mask[:, None] & r_mask[None, :]
        s = tl.load(s_ptr + sz, mask=sz_mask, other=0.0).to(dt)
        z = tl.load(z_ptr + sz, mask=sz_mask, other=0.0).to(dt)
        for h in tl.static_range(2):
            p = tl.load(qw16 + offs_r[None, :].to(tl.int64) * (2 * N) + 2 * offs_n[:, None] + h,
                        mask=n_mask[:, None] & r_mask[None, :], other=0)
            for j in tl.static_range(4):
                q = (p >> (4 * j)) & 0xF
                if MAGIC:  # (base + q) - (base + z) = q - z exactly
                    w = ((q | MAGIC).to(dt, bitcast=True) - (z + MAGIC_BASE)) * s
                else:
                    w = (q.to(dt) - z) * s
                offs_x = k0 + (4 * h + j) * PLANE + tl.arange(0, PLANE)
                xt = tl.load(x_ptr + rows_m[None, :] * stride_xm + offs_x[:, None], mask=m_mask[None, :], other=0.0)
                acc += tl.dot(w, xt, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + tl.program_id(1).to(tl.int64) * stride_os + rows_m[None, :] * stride_om + offs_n[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def w4a16_planes_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group: int, bias: Optional[torch.Tensor] = None, config: Optional[Config] = None,
                        num_sms: int = 132) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype, as kernels/w4a16.w4a16_linear (in-order groups of a multiple of 8
    inputs). ``config``: BLOCK_M, BLOCK_N, split, warps and stages (its block_k is PLANE_K, whatever given);
    by default 64 x 128, K split by kernels/w4a16.split_k, 4 warps, 3 stages."""
    if group % 8:
        raise ValueError(f'the W4A16 planes kernel takes groups of a multiple of 8 inputs, not {group}')
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or Config(64, 128, PLANE_K, split_k(m, n, k, 64, 128, num_sms), 4, 3)
    xp = permute_input(x)
    k_split = triton.cdiv(triton.cdiv(k, cfg.split), PLANE_K) * PLANE_K
    split = triton.cdiv(k, k_split)
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    has_bias = bias is not None and split == 1
    magic_bits, magic_base = MAGIC_OF.get(x.dtype, (0, 0.0))
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    _w4a16_planes_kernel[grid](xp, qweight, scales, zeros, bias if has_bias else x, dst, m, n, k, k_split,
                               xp.stride(0), n, m * n, GROUP=group, HAS_BIAS=has_bias, BLOCK_M=cfg.block_m,
                               BLOCK_N=cfg.block_n, GROUP_M=8, MAGIC=magic_bits, MAGIC_BASE=magic_base,
                               PRECISION='ieee' if x.dtype == torch.float32 else 'tf32', num_warps=cfg.warps,
                               num_stages=cfg.stages)
    return add_splits(dst, out, bias)
