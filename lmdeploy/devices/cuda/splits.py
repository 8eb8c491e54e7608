"""How the decode attention kernels (Triton and compiled) cut a context into slices; no Triton here, so
the compiled kernels work where Triton is missing.

Two numbers: the slices launched for each (sequence, KV head), fixed by the batch (and, in an eager step,
its longest context), and the fewest tokens a slice may hold, which each program applies to its own
sequence's length: a sequence of n tokens is cut into at most n // min_slice slices, the programs of the
slices it does not fill return at once, and the merge reads only those it filled (none for a sequence of
one slice, which its program writes out). So a decode graph, which is recorded for a batch size with the
session's length as the bound, still cuts only its long sequences."""
from __future__ import annotations

MAX_DECODE_SPLITS = 64  # batch 1 on an H100 cuts a long context into 64 slices (num_decode_splits)
TOKENS_PER_PROGRAM_PER_SM = 256  # min_slice_tokens: its scale (H100 sweeps, benchmark/kv_quant_attn.py)
MIN_SLICE_FLOOR = 256  # nor does an eager step launch slices shorter than this


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def min_slice_tokens(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """The fewest tokens a slice holds: 256 for each program an SM already has (batch x KV heads over the
    SMs), at least one 16-token tile. A slice costs a program's fixed work (q staged, the warps' merge, a
    partial row and its share of the merge), which only pays while too few programs would otherwise keep
    the memory system busy. H100, 64 sequences of 1,024 tokens (512 programs, 4 an SM): one slice read
    int4 1.5x and int8 1.2x faster than the 4 slices the batch alone gave (compiled), 16-bit 1.2x
    (Triton); batch 1 (8 programs) keeps slices of a tile."""
    programs = batch * num_kv_heads
    return max(16, (TOKENS_PER_PROGRAM_PER_SM * programs) // max(1, num_sms))


def num_decode_splits(batch: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """How many slices are launched for each sequence's context: about 16
    programs an SM, up to 8 slices (with context lengths as varied as real
    traffic, a long sequence's single program otherwise sets the kernel's
    time: on an H100 at batch 32, 57.9 us unsplit against 25.3 us in 8
    slices); at least 2 programs an SM for the smallest batches (batch 1 on
    an H100: 32); no slice under min_slice_tokens (nor 256 tokens) of the
    longest context. From ~160 sequences on (8 KV heads, 132 SMs), one
    slice: splitting then costs more than it balances."""
    programs = batch * num_kv_heads
    fill = (16 * num_sms) // programs
    balanced = min(8, 1 << (fill.bit_length() - 1)) if fill else 1
    want = max((2 * num_sms) // programs, balanced)
    shortest = max(MIN_SLICE_FLOOR, min_slice_tokens(batch, num_kv_heads, num_sms))
    by_len = max(1, max_kv_len // shortest)
    return min(MAX_DECODE_SPLITS, _next_power_of_2(max(1, min(want, by_len))))
