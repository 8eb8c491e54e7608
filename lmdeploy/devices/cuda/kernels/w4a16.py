"""W4A16 GEMM: y = x W^T (+ b) with W 4-bit, dequantized in registers (AWQ and GPTQ after repacking).

Layout (made once at load by devices/cuda/w4a16.py):

* ``qweight`` int32 [K/8, N]: nibble j (bits 4j..4j+3) of element [r, n] is q[n, 8r + j] (GPTQ's own
  packing: a tile of BLOCK_K/8 packed rows reads BLOCK_N contiguous int32s per row);
* ``scales``, ``zeros`` [G, N] in the activation dtype: W[n, k] = (q - z[g(k), n]) * s[g(k), n]. The zero
  stays an integer (exact in 16 bits), so (q - z) is exact and the product rounds once, as the reference's;
* g(k) = k // GROUP, or ``g_idx[k]`` (a GPTQ desc_act layer whose sorted groups are not all equal).

Three regimes by row count M (fixed tables: no autotuning, so a CUDA graph records the same launches and
start-up compiles nothing more than the shapes used). The fused kernel, configured by :func:`choose`:

* few rows (M <= 16, decode): memory bound, so the work is the packed weight read once. x is padded to
  16 rows for ``tl.dot``; K is split so that ~4 programs per SM stream their own part of the weight, the
  partial sums going to a float32 workspace that a second small kernel adds up (with the bias);
* up to DEQUANT_ROWS rows: a GEMM tile (BLOCK_M up to 64) with the dequantized B tile fed to tensor cores,
  programs grouped along M so that the weight tiles a wave reads stay in L2;

and from DEQUANT_ROWS rows on, the weight dequantized once into a 16-bit scratch matrix (:func:`dequantize`,
the same values as the fused kernel's) and multiplied by cuBLAS. The fused tile dequantizes each weight
element once per row tile, and that arithmetic, not memory, bounded it: on an H100 (benchmark/w4a16_gemm.py,
Llama-3-8B's layers) it ran at 0.24-0.42x of bf16's speed from 256 rows on, where dequantize-then-GEMM runs at
0.45-0.67x at 256 rows and 0.9-0.96x at 4,096 (a prefill's sizes). The scratch matrix is the layer's size in
16 bits (235 MB for Llama-3-8B's gate_up), allocated and freed per call from torch's cache.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .tiles import grouped_tile

SMALL_M = 16  # rows up to which the decode (split-K) configuration is used
DEQUANT_ROWS = 128  # rows from which the weight is dequantized and multiplied by cuBLAS
# rows up to which the fused kernel dequantizes in the activation dtype (the same values): on an H100 (session
# 43, benchmark/w4a16_gemm.py, Llama-3-8B's four layers) 3-9 % faster at 1-16 rows and 1-11 % at 32, slower at 64
DT_MATH_ROWS = 32


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split: int  # programs along K (1: the GEMM kernel writes the output itself)
    warps: int
    stages: int


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, b_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_om,
                  stride_os, GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  RESHAPE: tl.constexpr, PRECISION: tl.constexpr, DT_MATH: tl.constexpr = False):
    """One [BLOCK_M, BLOCK_N] tile of out over K range [pid_k K_SPLIT, (pid_k + 1) K_SPLIT); ``stride_os``:
    between the splits' partial outputs (a float32 workspace when there are several)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    rows_m = offs_m.to(tl.int64)  # (row offsets of x and out past 2^31 elements in a long prefill)
    n_mask = offs_n < N
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(K, k_start + K_SPLIT)
    dt = x_ptr.dtype.element_ty
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if RESHAPE:  # each int32 read once, its 8 values spread over 8 rows
            offs_p = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            p = tl.load(qw_ptr + offs_p[:, None].to(tl.int64) * N + offs_n[None, :],
                        mask=(offs_p < k_end // 8)[:, None] & n_mask[None, :], other=0)
            q = tl.reshape((p[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        else:  # each row reads its int32 (8 rows the same address: one memory read, 8 cache reads)
            p = tl.load(qw_ptr + (offs_k[:, None] // 8).to(tl.int64) * N + offs_n[None, :],
                        mask=k_mask[:, None] & n_mask[None, :], other=0)
            q = (p >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if HAS_GIDX:
            g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
            sz = g[:, None].to(tl.int64) * N + offs_n[None, :]
            sz_mask = k_mask[:, None] & n_mask[None, :]
        elif GROUP % BLOCK_K == 0:  # the whole tile in one group: one row of scales
            sz = (k0 // GROUP) * N + offs_n[None, :]
            sz_mask = n_mask[None, :]
        else:
            sz = (offs_k[:, None] // GROUP).to(tl.int64) * N + offs_n[None, :]
            sz_mask = k_mask[:, None] & n_mask[None, :]
        s = tl.load(s_ptr + sz, mask=sz_mask, other=0.0)
        z = tl.load(z_ptr + sz, mask=sz_mask, other=0.0)
        if DT_MATH:  # the same values: q - z is a small integer, exact in 16 bits, and the product rounds once
            w = (q.to(dt) - z.to(dt)) * s.to(dt)
        else:  # float32 (exact for (q - z) * s of a 16-bit s), rounded once as the reference's dequantized weight
            w = ((q.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)).to(dt)
        acc += tl.dot(x, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + pid_k.to(tl.int64) * stride_os + rows_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_splits_kernel(ws_ptr, b_ptr, out_ptr, M, N, SPLITS, stride_om, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m] = sum over the splits of the workspace's row m (+ bias), in float32, rounded once."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK, ), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(ws_ptr + (s * M + m).to(tl.int64) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, g_ptr, w_ptr, N, K, GROUP: tl.constexpr, HAS_GIDX: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """W^T [K, N] from the packed [K/8, N]: each packed row's 8 nibble planes stored as 8 rows of W^T (no
    reshape: plane j of packed row r is row 8 r + j)."""
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_p < K // 8)[:, None] & (offs_n < N)[None, :]
    p = tl.load(qw_ptr + offs_p[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask, other=0)
    dt = w_ptr.dtype.element_ty
    if not HAS_GIDX:  # (GROUP a multiple of 8: the 8 inputs of an int32 share a group)
        sz = (offs_p[:, None] * 8 // GROUP).to(tl.int64) * N + offs_n[None, :]
        s = tl.load(s_ptr + sz, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + sz, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(8):
        rows = offs_p * 8 + j
        if HAS_GIDX:
            g = tl.load(g_ptr + rows, mask=offs_p < K // 8, other=0)
            sz = g[:, None].to(tl.int64) * N + offs_n[None, :]
            s = tl.load(s_ptr + sz, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz, mask=mask, other=0.0).to(tl.float32)
        q = ((p >> (4 * j)) & 0xF).to(tl.float32)
        tl.store(w_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], ((q - z) * s).to(dt), mask=mask)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
               g_idx: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """W^T [K, N] (``dtype``, default the scales') of the packed layout: (q - z) * s rounded once, the fused
    kernel's values."""
    kp, n = qweight.shape
    w = torch.empty((kp * 8, n), dtype=dtype or scales.dtype, device=qweight.device)
    if kp == 0 or n == 0:
        return w
    block_p, block_n = 16, 128
    grid = (triton.cdiv(kp, block_p), triton.cdiv(n, block_n))
    _dequant_kernel[grid](qweight, scales, zeros, g_idx if g_idx is not None else qweight, w, n, kp * 8,
                          GROUP=group if g_idx is None else 8, HAS_GIDX=g_idx is not None, BLOCK_P=block_p,
                          BLOCK_N=block_n, num_warps=4)
    return w


def _block_k(block_k: int, group: int) -> int:
    """The table's BLOCK_K, or the group where that is a smaller power of two (>= 16, as tl.dot needs): a tile
    then lies in one group and reads one row of scales."""
    if group % block_k and 16 <= group < block_k and block_k % group == 0:
        return group
    return block_k


def choose(m: int, n: int, k: int, group: int, num_sms: int) -> Config:
    """Block sizes by shape (sized for an H100, 132 SMs; see benchmark/w4a16_gemm.py):

    =========  =======  =======  =======  =====  ======
    rows M     BLOCK_M  BLOCK_N  BLOCK_K  warps  stages
    =========  =======  =======  =======  =====  ======
    <= 16      16       64       128      4      4
    <= 64      32 / 64  64       64       4      4
    <= 256     64       128      64       4      3
    more       128      128      64       8      3
    =========  =======  =======  =======  =====  ======

    Split-K aims at 4 programs per SM, each split over 512 inputs at least, and the float32 workspace's
    traffic (write and read, 8 S M N bytes) at a quarter of the packed weight's (K N / 2): S <= K / (64 M).
    So M = 1 at N = K = 4096 runs 64 column tiles x 8 splits; M = 64 and more never split.
    """
    if m <= SMALL_M:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = (32 if m <= 32 else 64), 64, 64, 4, 4
    elif m <= 256:
        bm, bn, bk, warps, stages = 64, 128, 64, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    bk = _block_k(bk, group)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = min(triton.cdiv(4 * num_sms, tiles), max(1, k // 512), max(1, k // (64 * m)))
    return Config(bm, bn, bk, max(1, split), warps, stages)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 g_idx: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, num_sms: int = 132,
                 config: Optional[Config] = None, reshape: bool = True,
                 dt_math: Optional[bool] = None) -> torch.Tensor:
    """x [M, K] (contiguous rows) -> [M, N] in x's dtype. ``group``: inputs per group (ignored with
    ``g_idx`` int32 [K], the group of each input, non-decreasing or not). ``config``: the table's
    (:func:`choose`) unless given; ``reshape``: how the packed tile is unpacked (the kernel's RESHAPE);
    ``dt_math``: the weight dequantized in x's dtype rather than float32 (the same values), by default up to
    DT_MATH_ROWS rows, where it was measured faster."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    if dt_math is None:
        dt_math = m <= DT_MATH_ROWS
    if config is None and m >= DEQUANT_ROWS and (g_idx is not None or group % 8 == 0):
        w_t = dequantize(qweight, scales, zeros, group, g_idx, x.dtype)
        return torch.mm(x, w_t) if bias is None else torch.addmm(bias.to(x.dtype), x, w_t)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or choose(m, n, k, group if g_idx is None else 1, num_sms)
    k_split = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_split)  # no empty split
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    has_bias = bias is not None and split == 1
    _w4a16_kernel[grid](x, qweight, scales, zeros, g_idx if g_idx is not None else qweight,
                        bias if has_bias else x, dst, m, n, k, k_split, x.stride(0), n, m * n,
                        GROUP=group if g_idx is None else 1, HAS_GIDX=g_idx is not None, HAS_BIAS=has_bias,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8, RESHAPE=reshape,
                        DT_MATH=dt_math and x.dtype != torch.float32,
                        PRECISION='ieee' if x.dtype == torch.float32 else 'tf32', num_warps=cfg.warps,
                        num_stages=cfg.stages)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(m, triton.cdiv(n, block))](dst, bias if bias is not None else dst, out, m, n, split,
                                                       out.stride(0), HAS_BIAS=bias is not None, BLOCK=block,
                                                       num_warps=4)
    return out


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] (K a multiple of 8) -> int32 [K/8, N], nibble j of [r, n] holding q[n, 8r+j].
    Built in int32 a nibble at a time (a model's largest layer at load: no int64 copy of it), the top nibble
    signed so that no sum leaves int32's range."""
    n, k = q.shape
    rows = q.t().reshape(k // 8, 8, n)
    packed = torch.zeros((k // 8, n), dtype=torch.int32, device=q.device)
    for j in range(8):
        v = rows[:, j].to(torch.int32)
        if j == 7:
            v = torch.where(v >= 8, v - 16, v)
        packed += v * (1 << (4 * j))
    return packed
