"""W4A16 GEMM: y = x W^T (+ b) with W 4-bit, dequantized in registers (AWQ and GPTQ after repacking).

Layout (made once at load by devices/cuda/w4a16.py):

* ``qweight`` int32 [K/8, N]: nibble j (bits 4j..4j+3) of element [r, n] is q[n, 8r + j] (GPTQ's own
  packing: a tile of BLOCK_K/8 packed rows reads BLOCK_N contiguous int32s per row);
* ``scales``, ``zeros`` [G, N] in the activation dtype: W[n, k] = (q - z[g(k), n]) * s[g(k), n]. The zero
  stays an integer (exact in 16 bits), so (q - z) is exact and the product rounds once, as the reference's;
* g(k) = k // GROUP, or ``g_idx[k]`` (a GPTQ desc_act layer whose sorted groups are not all equal).

Four regimes by row count M (fixed tables: no autotuning, so a CUDA graph records the same launches and
start-up compiles nothing more than the shapes used):

* up to GEMV_ROWS rows (a small decode batch): :func:`_w4a16_gemv_kernel`, no tensor cores. The work is the
  packed weight read once at memory speed, so the unpacking must cost less than the read: a nibble becomes a
  float by or-ing it into the mantissa of 2^23 (one logic op, no int-to-float conversion, which runs at a
  quarter of the FMA rate), the zero point is subtracted exactly, and the group's scale is applied once per
  int32 rather than per input. K is split over programs; the last program of a column tile to finish adds
  the partial sums up (in split order: deterministic) and writes the output, so one launch does it all. On
  an H100 at one row (Llama-3-8B's qkv, o, gate_up, down) 11.1 / 9.7 / 34.6 / 22.3 us against the split-K
  tensor-core kernel's 18.8 / 14.9 / 65.6 / 38.1 (1.2-1.8 TB/s of packed weight; bf16 cuBLAS reads ~2.8);
* few rows (GEMV_ROWS < M <= 16, decode), the fused kernel configured by :func:`choose`, with the operands
  swapped (out^T = W x^T, :func:`_w4a16_swap_kernel`): memory bound, so the work is the packed weight read
  once. x is padded to 16 rows for ``tl.dot``; K is split so that ~4 programs per SM stream their own part of
  the weight, the partial sums going to a float32 workspace that a second small kernel adds up (with the bias);
* up to DEQUANT_ROWS rows (up to 255 on layers WIDE_N wide): a GEMM tile with the dequantized weight tile fed
  to tensor cores (swapped up to 64 rows), programs grouped along M so that the weight tiles a wave reads stay
  in L2;

and from there on, the weight dequantized once into a 16-bit scratch matrix (:func:`dequantize`, the same
values as the fused kernel's) and multiplied by cuBLAS. The fused tile dequantizes each weight
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

# rows up to which the GEMV kernel is used (each row costs an FMA per weight element): on an H100 (session 47,
# benchmark/w4a16_gemm.py --gemv-sweep) it beat the tensor-core split-K kernel at 1 and 2 rows, not at 4
GEMV_ROWS = 2
SMALL_M = 16  # rows up to which the decode (split-K) configuration is used
DEQUANT_ROWS = 128  # rows from which the weight is dequantized and multiplied by cuBLAS (but see WIDE_N)
WIDE_N = 16384  # outputs from which a layer (gate_up) keeps the fused tile up to WIDE_DEQUANT_ROWS (:func:`choose`)
WIDE_DEQUANT_ROWS = 256  # rows from which such a layer is dequantized and multiplied by cuBLAS too
# rows up to which the fused kernel dequantizes in the activation dtype (the same values): on an H100 (session
# 43, benchmark/w4a16_gemm.py, Llama-3-8B's four layers) 3-9 % faster at 1-16 rows and 1-11 % at 32, slower at 64
DT_MATH_ROWS = 32
# a 16-bit float whose mantissa's last 4 bits count in ones (MAGIC in the kernel): its bits and value
MAGIC_OF = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


class GemvConfig(NamedTuple):
    block_p: int  # packed (int32) rows of a tile: 8 inputs each
    block_n: int
    split: int  # programs along K
    warps: int
    stages: int


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split: int  # programs along K (1: the GEMM kernel writes the output itself)
    warps: int
    stages: int
    swap: bool = False  # the operands swapped (:func:`_w4a16_swap_kernel`)


@triton.jit
def _dequant(q, s, z, dt, DT_MATH: tl.constexpr, MAGIC: tl.constexpr, MAGIC_BASE: tl.constexpr):
    """(q - z) s in ``dt``, rounded once, for nibbles ``q`` (int32) and their scales and zeros (broadcast)."""
    if DT_MATH and MAGIC:  # (base + q) - (base + z) = q - z exactly: the same values as below
        return ((q | MAGIC).to(tl.int16).to(dt, bitcast=True) - (z.to(dt) + MAGIC_BASE)) * s.to(dt)
    elif DT_MATH:  # the same values: q - z is a small integer, exact in 16 bits, and the product rounds once
        return (q.to(dt) - z.to(dt)) * s.to(dt)
    else:  # float32 (exact for (q - z) * s of a 16-bit s), rounded once as the reference's dequantized weight
        return ((q.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)).to(dt)


@triton.jit
def _tile(M, N, K, K_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile and K range: (offs_m, offs_n, rows_m (int64: row offsets of x and out past
    2^31 elements in a long prefill), m_mask, n_mask, k_start, k_end)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * K_SPLIT
    return offs_m, offs_n, offs_m.to(tl.int64), offs_m < M, offs_n < N, k_start, tl.minimum(K, k_start + K_SPLIT)


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, b_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_om,
                  stride_os, GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  RESHAPE: tl.constexpr, PRECISION: tl.constexpr, DT_MATH: tl.constexpr = False,
                  MAGIC: tl.constexpr = 0, MAGIC_BASE: tl.constexpr = 0.0):
    """One [BLOCK_M, BLOCK_N] tile of out over K range [pid_k K_SPLIT, (pid_k + 1) K_SPLIT); ``stride_os``:
    between the splits' partial outputs (a float32 workspace when there are several). ``MAGIC`` (with
    DT_MATH): the 16-bit pattern of MAGIC_BASE, 2^7 in bfloat16 or 2^10 in float16, whose last mantissa bits
    are 0..15 apart by 1: or-ing a nibble into it gives MAGIC_BASE + q with no int-to-float conversion."""
    offs_m, offs_n, rows_m, m_mask, n_mask, k_start, k_end = _tile(M, N, K, K_SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
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
        acc += tl.dot(x, _dequant(q, s, z, dt, DT_MATH, MAGIC, MAGIC_BASE), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tl.program_id(1).to(tl.int64) * stride_os + rows_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _w4a16_swap_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, b_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_om,
                       stride_os, GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       PRECISION: tl.constexpr, DT_MATH: tl.constexpr = False, MAGIC: tl.constexpr = 0,
                       MAGIC_BASE: tl.constexpr = 0.0):
    """:func:`_w4a16_kernel`'s tile with the product's operands swapped, out^T = W x^T: the dequantized weight
    [BLOCK_N, BLOCK_K] is the left operand, the one Hopper's wgmma can take from registers, and the rows of x
    the product's narrow side (BLOCK_M from 16), as in Marlin's and Machete's designs. (Triton 3.6 still moves
    the dequantized tile through shared memory to give it the operand's layout: its sm90 IR, session 49. The
    tile was measured faster than the plain one up to 64 rows, slower from 128.)"""
    offs_m, offs_n, rows_m, m_mask, n_mask, k_start, k_end = _tile(M, N, K, K_SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
    dt = x_ptr.dtype.element_ty
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        xt = tl.load(x_ptr + rows_m[None, :] * stride_xm + offs_k[:, None], mask=k_mask[:, None] & m_mask[None, :],
                     other=0.0)
        offs_p = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        p = tl.load(qw_ptr + offs_p[None, :].to(tl.int64) * N + offs_n[:, None],
                    mask=n_mask[:, None] & (offs_p < k_end // 8)[None, :], other=0)
        q = tl.reshape((p[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
        if HAS_GIDX:
            g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
            sz = g[None, :].to(tl.int64) * N + offs_n[:, None]
            sz_mask = n_mask[:, None] & k_mask[None, :]
        elif GROUP % BLOCK_K == 0:
            sz = (k0 // GROUP) * N + offs_n[:, None]
            sz_mask = n_mask[:, None]
        else:
            sz = (offs_k[None, :] // GROUP).to(tl.int64) * N + offs_n[:, None]
            sz_mask = n_mask[:, None] & k_mask[None, :]
        s = tl.load(s_ptr + sz, mask=sz_mask, other=0.0)
        z = tl.load(z_ptr + sz, mask=sz_mask, other=0.0)
        acc += tl.dot(_dequant(q, s, z, dt, DT_MATH, MAGIC, MAGIC_BASE), xt, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + tl.program_id(1).to(tl.int64) * stride_os + rows_m[None, :] * stride_om + offs_n[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


MANTISSA_ONE = tl.constexpr(0x4B000000)  # 2^23's bits in float32: or-ing an integer below 2^23 in adds it


@triton.jit
def _nibble(p, p_hi, z, j: tl.constexpr):
    """(q_j - z) 2^(4 e) exactly, as float32, for nibble j of the int32s ``p`` (``p_hi``: p >> 12), without a
    shift or an int-to-float conversion: the nibble, left at bits 4e..4e+3 (e = j for j <= 4, else j - 3 in
    p_hi), is or-ed into the mantissa of 2^23, whose last place is worth 1: the float is 2^23 + q 2^(4 e).
    ``z``: the zero point (float32)."""
    e: tl.constexpr = j if j <= 4 else j - 3
    src = p if j <= 4 else p_hi
    f = ((src & (0xF << (4 * e))) | MANTISSA_ONE).to(tl.float32, bitcast=True)
    return f - (z * (2.0**(4 * e)) + 8388608.0)


@triton.jit
def _gemv_row(acc, x_ptr, row, m_p, offs_p, p_mask, j: tl.constexpr, w):
    """acc + x[row, 8 p + j] w[p, n] (w scaled by 2^(4 e): x by 2^(-4 e), exact), one row's share of a nibble
    plane (2-D tensors only: a third dimension for the rows made Triton move every unpacked tile through
    shared memory)."""
    e: tl.constexpr = j if j <= 4 else j - 3
    xj = tl.load(x_ptr + offs_p * 8 + j, mask=p_mask & (row < m_p), other=0.0).to(tl.float32)
    return acc + (xj * 2.0**(-4 * e))[:, None] * w


@triton.jit
def _gemv_store(part, out_ptr, row, m_n, stride_om, offs_n, n_mask):
    tl.store(out_ptr + row * stride_om + offs_n, part.to(out_ptr.dtype.element_ty), mask=n_mask & (row < m_n))


@triton.jit
def _gemv_load(qw_ptr, s_ptr, z_ptr, p0, p_end, N, offs_n, n_mask, GROUP: tl.constexpr, BLOCK_P: tl.constexpr):
    """The packed tile at packed row p0 (p0 < p_end), its scales and zeros (float32)."""
    offs_p = p0 + tl.arange(0, BLOCK_P)
    p_mask = offs_p < p_end
    p = tl.load(qw_ptr + offs_p[:, None].to(tl.int64) * N + offs_n[None, :],
                mask=p_mask[:, None] & n_mask[None, :], other=0)
    if GROUP % (8 * BLOCK_P) == 0:  # the tile in one group: one row of scales and zeros
        sz = (p0 * 8 // GROUP) * N + offs_n[None, :]
        sz_mask = n_mask[None, :]
    else:
        sz = (offs_p[:, None] * 8 // GROUP).to(tl.int64) * N + offs_n[None, :]
        sz_mask = p_mask[:, None] & n_mask[None, :]
    s = tl.load(s_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
    return p, s, z


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, ws_ptr, lock_ptr, out_ptr, M, N, K, P_SPLIT,
                       stride_xm, stride_om, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """out[:M, tile] for M <= ROWS <= 4 over packed rows [pid_k P_SPLIT, (pid_k + 1) P_SPLIT); GROUP a multiple
    of 8 (an int32's 8 inputs share a group). With SPLIT > 1 each program writes its partial sums to the
    float32 workspace ``ws`` [SPLIT, M, N] and counts itself in ``lock[pid_n]``; the last one adds the splits
    in order (+ bias), writes out and sets the count back to 0 for the next call. (Loading the next tile
    before unpacking this one measured slower on an H100: more registers, fewer programs per SM.)"""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    p_start = pid_k * P_SPLIT
    p_end = tl.minimum(K // 8, p_start + P_SPLIT)
    m_p = tl.zeros((BLOCK_P, ), dtype=tl.int32) + M  # (M as vectors: row < M a mask, in the interpreter too)
    m_n = tl.zeros((BLOCK_N, ), dtype=tl.int32) + M
    t0 = tl.zeros((BLOCK_N, ), dtype=tl.float32)  # per row: the sums of scaled tiles
    t1 = t0
    t2 = t0
    t3 = t0
    for p0 in range(p_start, p_end, BLOCK_P):
        p, s, z = _gemv_load(qw_ptr, s_ptr, z_ptr, p0, p_end, N, offs_n, n_mask, GROUP, BLOCK_P)
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_mask = offs_p < p_end
        p_hi = p >> 12
        a0 = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        for j in tl.static_range(8):  # input 8 r + j of packed row r: nibble j
            w = _nibble(p, p_hi, z, j)
            a0 = _gemv_row(a0, x_ptr, 0, m_p, offs_p, p_mask, j, w)
            if ROWS > 1:
                a1 = _gemv_row(a1, x_ptr + stride_xm, 1, m_p, offs_p, p_mask, j, w)
            if ROWS > 2:
                a2 = _gemv_row(a2, x_ptr + 2 * stride_xm, 2, m_p, offs_p, p_mask, j, w)
                a3 = _gemv_row(a3, x_ptr + 3 * stride_xm, 3, m_p, offs_p, p_mask, j, w)
        # (the tile's rows summed at once: BLOCK_N = 128 x warps puts every warp along N, a row's sums in a thread)
        t0 += tl.sum(a0 * s, axis=0)
        if ROWS > 1:
            t1 += tl.sum(a1 * s, axis=0)
        if ROWS > 2:
            t2 += tl.sum(a2 * s, axis=0)
            t3 += tl.sum(a3 * s, axis=0)
    if SPLIT > 1:  # this program's partial sums, counted; the last program of the tile goes on
        tl.store(ws_ptr + pid_k * M * N + offs_n, t0, mask=n_mask)
        if ROWS > 1:
            tl.store(ws_ptr + (pid_k * M + 1) * N + offs_n, t1, mask=n_mask & (1 < m_n))
        if ROWS > 2:
            tl.store(ws_ptr + (pid_k * M + 2) * N + offs_n, t2, mask=n_mask & (2 < m_n))
            tl.store(ws_ptr + (pid_k * M + 3) * N + offs_n, t3, mask=n_mask & (3 < m_n))
        tl.debug_barrier()  # every thread's partial sums written before the count says so (a release, gpu-wide)
        last = tl.atomic_add(lock_ptr + pid_n, 1, sem='acq_rel', scope='gpu') == SPLIT - 1
    else:
        last = True
    if last:
        bias = tl.zeros((BLOCK_N, ), dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        for row in tl.static_range(ROWS):
            if SPLIT > 1:  # the splits in order (.cg: from L2, where the other programs wrote; no stale L1 line)
                part = tl.zeros((BLOCK_N, ), dtype=tl.float32)
                for k in range(SPLIT):
                    part += tl.load(ws_ptr + (k * M + row) * N + offs_n, mask=n_mask & (row < m_n), other=0.0,
                                    cache_modifier='.cg')
            elif row == 0:
                part = t0
            elif row == 1:
                part = t1
            elif row == 2:
                part = t2
            else:
                part = t3
            _gemv_store(part + bias, out_ptr, row, m_n, stride_om, offs_n, n_mask)
        if SPLIT > 1:
            tl.atomic_xchg(lock_ptr + pid_n, 0)


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


def choose(m: int, n: int, k: int, group: int, num_sms: int) -> Optional[Config]:
    """The fused kernel's tile by shape, or None where dequantize + cuBLAS is faster (sized on an H200, 132 SMs,
    benchmark/w4a16_gemm.py --gemm-sweep over Llama-3-8B's layers, session 49):

    ========  ===========  =======  =======  =======  =======  =====  ======
    rows M    layer        tile     BLOCK_M  BLOCK_N  BLOCK_K  warps  stages
    ========  ===========  =======  =======  =======  =======  =====  ======
    <= 16     any          swapped  16       64       128      4      4
    <= 64     N < WIDE_N   swapped  32       64       128      4      4
    <= 64     N >= WIDE_N  plain    64       128      128      4      3
    < 128     any          plain    128      128      64       8      3
    < 256     N >= WIDE_N  plain    128      128      64       8      3
    otherwise dequantize + cuBLAS
    ========  ===========  =======  =======  =======  =======  =====  ======

    Swapped: out^T = W x^T (BLOCK_N 64 the weight's side), from 1.0x the plain tile at 16 rows to 1.5x at 64
    (o_proj: 32.4 us against 47.9). The plain tile dequantizes each weight element once per BLOCK_M rows and
    that arithmetic bounds it (0.3-0.5x bf16 cuBLAS from 64 rows on), while dequantize + cuBLAS pays a fixed
    pass over the weight: that pass wins from 128 rows on except on gate_up (N 28,672: 189 us against the
    plain tile's 108 at 128 rows; 177 against 195 at 256). Rows 65-127 were not swept: the plain tile there is
    the one best at 128 rows.

    Split-K (:func:`split_k`) aims at 4 programs per SM, each split over 512 inputs at least, and the float32
    workspace's traffic (write and read, 8 S M N bytes) at a quarter of the packed weight's (K N / 2):
    S <= K / (64 M). So M = 1 at N = K = 4096 runs 64 column tiles x 8 splits; M = 64 and more never split.
    """
    if m <= SMALL_M:
        bm, bn, bk, warps, stages, swap = 16, 64, 128, 4, 4, True
    elif m <= 64:
        bm, bn, bk, warps, stages, swap = (32, 64, 128, 4, 4, True) if n < WIDE_N else (64, 128, 128, 4, 3, False)
    elif m < (WIDE_DEQUANT_ROWS if n >= WIDE_N else DEQUANT_ROWS):
        bm, bn, bk, warps, stages, swap = 128, 128, 64, 8, 3, False
    else:
        return None
    return Config(bm, bn, _block_k(bk, group), split_k(m, n, k, bm, bn, num_sms), warps, stages, swap)


def split_k(m: int, n: int, k: int, block_m: int, block_n: int, num_sms: int) -> int:
    """Programs along K for a tile (:func:`choose`'s rule)."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return max(1, min(triton.cdiv(4 * num_sms, tiles), max(1, k // 512), max(1, k // (64 * m))))


LOCK_SLOTS = 1 << 14  # column tiles one GEMV call may count in (N up to 2M at BLOCK_N 128)
_locks: dict = {}


def reserve_locks(device: torch.device) -> torch.Tensor:
    """The GEMV kernel's counters on ``device`` (int32, zero; every call leaves them at zero), made once. Called
    when a layer is loaded, so that no CUDA graph records their allocation."""
    key = str(device)
    if key not in _locks:
        _locks[key] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)
    return _locks[key]


def gemv_choose(m: int, n: int, k: int, group: int, num_sms: int) -> GemvConfig:
    """The GEMV kernel's tile: 8 packed rows (64 inputs) by 512 columns for 4 warps (BLOCK_N = 128 per warp
    puts the warps side by side along N: a thread's 4 columns and all 8 rows in its registers, each row a
    16-byte read, the tile's sum over rows without shared memory).

    K is split for ~4 programs per SM, each over 2 tiles at least, and 64 splits at most: the last program
    adds the splits up one after the other, and at 112 splits (8B's down_proj, 2 tiles each) that took 41 us
    against 22 at 56. At one row, where that leaves fewer than 16 splits (many column tiles: gate_up), ~8
    programs per SM: 8B's gate_up took 34.9 us at 19 splits against 39.2 at 10. Twice as many programs
    everywhere lost on the 70B layers (o_proj 34.3 us at 64 splits against 22.3 at 33, down_proj 90.8 against
    65.1). Measured on an H100 (benchmark/w4a16_gemm.py --gemv-sweep, the 8B and 70B shapes)."""
    block_p, block_n = 8, 512
    tiles = triton.cdiv(n, block_n)
    split = triton.cdiv(4 * num_sms, tiles)
    if m == 1 and split < 16:
        split = triton.cdiv(8 * num_sms, tiles)
    split = max(1, min(split, k // 8 // (2 * block_p), 64))
    return GemvConfig(block_p, block_n, split, 4, 1)


def _gemv(x, qweight, scales, zeros, group, bias, num_sms, cfg: Optional[GemvConfig]):
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = cfg or gemv_choose(m, n, k, group, num_sms)
    kp = k // 8
    p_split = triton.cdiv(triton.cdiv(kp, cfg.split), cfg.block_p) * cfg.block_p  # tiles stay in one group
    split = triton.cdiv(kp, p_split)
    tiles = triton.cdiv(n, cfg.block_n)
    if split > 1 and tiles > LOCK_SLOTS:
        raise ValueError(f'W4A16 GEMV: {tiles} column tiles, more than the {LOCK_SLOTS} counters')
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    locks = reserve_locks(x.device) if split > 1 else out
    _w4a16_gemv_kernel[(tiles, split)](x, qweight, scales, zeros, bias if bias is not None else x, ws, locks, out,
                                       m, n, k, p_split, x.stride(0), out.stride(0), GROUP=group,
                                       HAS_BIAS=bias is not None, ROWS=triton.next_power_of_2(m),
                                       BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n, SPLIT=split, num_warps=cfg.warps,
                                       num_stages=cfg.stages)
    return out


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 g_idx: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, num_sms: int = 132,
                 config: Optional[Config] = None, reshape: bool = True, dt_math: Optional[bool] = None,
                 gemv=None, magic: Optional[bool] = None) -> torch.Tensor:
    """x [M, K] (contiguous rows) -> [M, N] in x's dtype. ``group``: inputs per group (ignored with
    ``g_idx`` int32 [K], the group of each input, non-decreasing or not). ``config``: the table's
    (:func:`choose`) unless given; ``reshape``: how the packed tile is unpacked (the kernel's RESHAPE);
    ``dt_math``: the weight dequantized in x's dtype rather than float32 (the same values), by default up to
    DT_MATH_ROWS rows and with the swapped tile, where it was measured faster; ``magic`` (with it, by
    default): the nibbles made 16-bit floats by or-ing them into a constant's mantissa instead of converting
    them (the same values; on an H200 up to 25 % faster, 1 % slower at worst: benchmark/w4a16_gemm.py
    --gemm-sweep). ``gemv``: the GEMV kernel's use, by default up to GEMV_ROWS rows where groups are in order
    and a multiple of 8; False never, a :class:`GemvConfig` forces it with that tile."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    gemv_ok = g_idx is None and group % 8 == 0
    if isinstance(gemv, GemvConfig) or (gemv is None and config is None and gemv_ok and m <= GEMV_ROWS):
        if not gemv_ok or m > 4:
            raise ValueError('the W4A16 GEMV takes up to 4 rows, with in-order groups of a multiple of 8 inputs')
        return _gemv(x, qweight, scales, zeros, group, bias, num_sms, gemv if isinstance(gemv, GemvConfig) else None)
    cfg = config or choose(m, n, k, group if g_idx is None else 1, num_sms)
    if cfg is None and (g_idx is not None or group % 8 == 0):
        w_t = dequantize(qweight, scales, zeros, group, g_idx, x.dtype)
        return torch.mm(x, w_t) if bias is None else torch.addmm(bias.to(x.dtype), x, w_t)
    if cfg is None:  # a group that splits an int32's 8 inputs: only the fused tile, the table's widest
        cfg = choose(DEQUANT_ROWS - 1, n, k, group, num_sms)
    if config is None and x.dtype == torch.float32 and cfg.stages > 2:
        # float32 tiles hold twice the bytes: the widest took 232 KB in 3 stages, more than an H200 has (sm90's
        # 227 KB); 2 stages fit everywhere the 16-bit tiles do
        cfg = cfg._replace(stages=2)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if dt_math is None:
        dt_math = cfg.swap or m <= DT_MATH_ROWS
    if magic is None:
        magic = dt_math
    k_split = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_split)  # no empty split
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    has_bias = bias is not None and split == 1
    dt_math = dt_math and x.dtype != torch.float32
    magic_bits, magic_base = MAGIC_OF.get(x.dtype, (0, 0.0)) if magic and dt_math else (0, 0.0)
    kernel, extra = (_w4a16_swap_kernel, {}) if cfg.swap else (_w4a16_kernel, dict(RESHAPE=reshape))
    kernel[grid](x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, bias if has_bias else x, dst, m,
                 n, k, k_split, x.stride(0), n, m * n, GROUP=group if g_idx is None else 1, HAS_GIDX=g_idx is not None,
                 HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8,
                 DT_MATH=dt_math, MAGIC=magic_bits, MAGIC_BASE=magic_base,
                 PRECISION='ieee' if x.dtype == torch.float32 else 'tf32', num_warps=cfg.warps,
                 num_stages=cfg.stages, **extra)
    return add_splits(dst, out, bias)


def add_splits(dst: torch.Tensor, out: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``out`` itself where the tile kernel wrote it (``dst`` is ``out``), else the float32 partial sums
    ``dst`` [split, M, N] added up into it, in order, with the bias."""
    if dst is not out:
        m, n = out.shape
        block = 1024
        _sum_splits_kernel[(m, triton.cdiv(n, block))](dst, bias if bias is not None else dst, out, m, n,
                                                       dst.shape[0], out.stride(0), HAS_BIAS=bias is not None,
                                                       BLOCK=block, num_warps=4)
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
