"""Counter-based random numbers that every device can reproduce bit for bit.

u(seed, offset, i) depends only on its three integers, so sampling a row
never depends on what else is in the batch. The hash is a 32-bit avalanche
mix (xor-shift / multiply); multiplies are split in 16-bit halves so that no
intermediate exceeds int64 (kernels in other languages can use plain
uint32 arithmetic and get the same bits).
"""
import torch

_M32 = 0xFFFFFFFF
_K1 = 0x7FEB352D
_K2 = 0x846CA68B
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32)."""
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _K1)
    x = x ^ (x >> 15)
    x = _mul32(x, _K2)
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 in (0, 1): u[b, i] = hash(seeds[b], offsets[b], i)."""
    dev = seeds.device
    s = seeds.to(torch.int64) & _M32
    o = offsets.to(torch.int64) & _M32
    row = mix32(s ^ mix32((o + _GOLDEN) & _M32))  # [B]
    ids = torch.arange(vocab_size, device=dev, dtype=torch.int64)
    h = mix32((row[:, None] + _mul32(ids, _GOLDEN)[None, :]) & _M32)
    # 23 random bits, centred in their bucket: never exactly 0 or 1. (With 24
    # bits, (2**24 - 1) + 0.5 is not a float32 and rounds up to 1.0.)
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
