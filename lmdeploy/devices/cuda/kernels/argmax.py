"""Row-wise argmax of the logits (greedy decoding) in two short launches.

One long row reduced by one program is slow (a 128k vocabulary took 27 us
on an H100 that way); here slices of CHUNK logits are reduced in parallel,
then their maxima. Ties go to the lowest index, as torch.argmax.
"""
import torch
import triton
import triton.language as tl

from . import pdl

CHUNK = 2048


@triton.jit
def _argmax_slices_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, n_slices, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * CHUNK
    end = tl.minimum(V, start + CHUNK)
    lanes = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float('-inf'), dtype=tl.float32)
    best_i = start + lanes
    for off in range(0, CHUNK, BLOCK):
        cols = start + off + lanes
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=float('-inf')).to(tl.float32)
        take = x > best_v  # strictly: a lane keeps its first maximum
        best_v = tl.where(take, x, best_v)
        best_i = tl.where(take, cols, best_i)
    top = tl.max(best_v, axis=0)
    first = tl.min(tl.where(best_v == top, best_i, 2147483647), axis=0)
    tl.store(val_ptr + row * n_slices + tl.program_id(1), top)
    tl.store(idx_ptr + row * n_slices + tl.program_id(1), first)


@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, n_slices, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    valid = s < n_slices
    v = tl.load(val_ptr + row * n_slices + s, mask=valid, other=float('-inf'))
    i = tl.load(idx_ptr + row * n_slices + s, mask=valid, other=2147483647)
    top = tl.max(v, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(v == top, i, 2147483647), axis=0).to(tl.int64))


def reduce_by_slices(logits: torch.Tensor, launch_slices) -> torch.Tensor:
    """Per row of logits [B, V], the index a slices kernel picks: ``launch_slices(logits, vals, idx, n)``
    launches it on the grid (B, n) to write each slice's best value and index; a second launch takes the
    best of the slices (ties: lowest index). argmax and the seeded draw (sample.py) share it."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    n = triton.cdiv(v, CHUNK)
    vals = torch.empty((b, n), dtype=torch.float32, device=logits.device)
    idx = torch.empty((b, n), dtype=torch.int32, device=logits.device)
    launch_slices(logits, vals, idx, n)
    _argmax_merge_kernel[(b, )](vals, idx, out, n, BLOCK_S=max(16, triton.next_power_of_2(n)), num_warps=1,
                                PDL=pdl.ON, **pdl.LAUNCH)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    def launch(x, vals, idx, n):
        _argmax_slices_kernel[(x.shape[0], n)](x, vals, idx, x.shape[1], x.stride(0), n, CHUNK=CHUNK, BLOCK=1024,
                                               num_warps=4, PDL=pdl.ON, **pdl.LAUNCH)
    return reduce_by_slices(logits, launch)
