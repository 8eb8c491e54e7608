"""How the decode attention kernels (Triton and compiled) cut a context into slices; no Triton here, so
the compiled kernels work where Triton is missing."""
from __future__ import annotations

MAX_DECODE_SPLITS = 64  # batch 1 on an H100 cuts a long context into 64 slices (num_decode_splits)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_decode_splits(batch: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """How many slices each sequence's context is cut into: about 16 programs
    an SM, up to 8 slices (with context lengths as varied as real traffic, a
    long sequence's single program otherwise sets the kernel's time: on an
    H100 at batch 32, 57.9 us unsplit against 25.3 us in 8 slices); at least
    2 programs an SM for the smallest batches (batch 1 on an H100: 32); no
    slice under 256 tokens. From ~160 sequences on (8 KV heads, 132 SMs),
    one slice: splitting then costs more than it balances."""
    programs = batch * num_kv_heads
    fill = (16 * num_sms) // programs
    balanced = min(8, 1 << (fill.bit_length() - 1)) if fill else 1
    want = max((2 * num_sms) // programs, balanced)
    by_len = max(1, max_kv_len // 256)
    return min(MAX_DECODE_SPLITS, _next_power_of_2(max(1, min(want, by_len))))
