"""The seeded draw (``DeviceOps.sample``) in two short launches instead of
the reference's ~60 torch ops over [rows, vocabulary].

The reference draws argmax(p_i / r_i) with p = softmax(logits) and
r_i = -log u_i, u from devices/rng.py's counter-based hash. Here the hash
runs in the kernel (the same 32-bit mix in int64 halves, so the bits are
the reference's) and the comparison is made on log(p_i / r_i) + log Z =
l_i - log r_i, which orders the tokens as p_i / r_i does without a softmax
pass (a token whose probability underflows to 0 in the reference is
thousands of times below the winner here too). Slices of CHUNK columns are
reduced in parallel, then their maxima, as in argmax.py.
"""
import torch
import triton
import triton.language as tl

from . import pdl
from .argmax import CHUNK, reduce_by_slices



@triton.jit
def _mul32(x, c: tl.constexpr):
    """(x * c) mod 2**32 for int64 x in [0, 2**32), in 16-bit halves (no int64 overflow)."""
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _sample_slices_kernel(x_ptr, seed_ptr, offset_ptr, val_ptr, idx_ptr, V, stride_x, n_slices, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + row).to(tl.int64) & 0xFFFFFFFF
    offset = tl.load(offset_ptr + row).to(tl.int64) & 0xFFFFFFFF
    row_hash = _mix32(seed ^ _mix32((offset + 0x9E3779B9) & 0xFFFFFFFF))
    start = tl.program_id(1) * CHUNK
    end = tl.minimum(V, start + CHUNK)
    lanes = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float('-inf'), dtype=tl.float32)
    best_i = start + lanes
    for off in range(0, CHUNK, BLOCK):
        cols = start + off + lanes
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=float('-inf')).to(tl.float32)
        h = _mix32((row_hash + _mul32(cols.to(tl.int64), 0x9E3779B9)) & 0xFFFFFFFF)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits, never 0 or 1
        key = x - tl.log(-tl.log(u))
        take = key > best_v  # strictly: a lane keeps its first maximum
        best_v = tl.where(take, key, best_v)
        best_i = tl.where(take, cols, best_i)
    top = tl.max(best_v, axis=0)
    first = tl.min(tl.where(best_v == top, best_i, 2147483647), axis=0)
    tl.store(val_ptr + row * n_slices + tl.program_id(1), top)
    tl.store(idx_ptr + row * n_slices + tl.program_id(1), first)


def sample(logits: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (float32, after temperature and filters), seeds and offsets [B] -> tokens [B] int64."""
    def launch(x, vals, idx, n):
        _sample_slices_kernel[(x.shape[0], n)](x, seeds.contiguous(), offsets.contiguous(), vals, idx, x.shape[1],
                                               x.stride(0), n, CHUNK=CHUNK, BLOCK=1024, num_warps=4, PDL=pdl.ON,
                                               **pdl.LAUNCH)
    return reduce_by_slices(logits, launch)
