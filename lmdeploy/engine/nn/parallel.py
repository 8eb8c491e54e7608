"""Tensor parallelism: which part of each weight this process's rank holds.

Each rank is one process on one device; the model is built once per rank with
:func:`set_tensor_parallel` telling the layers which shard to hold. The
splits (Megatron-style):

* attention: whole KV heads per rank with their groups of query heads (q/k/v
  rows and o_proj columns); with fewer KV heads than ranks, each KV head is
  replicated on ``tp / num_kv_heads`` ranks and its query heads are split
  among them;
* MLP: gate/up rows and down_proj columns;
* embedding and LM head: rows of the vocabulary;
* everything else (norms, rotary) whole on every rank.

Row-parallel layers (o_proj, down_proj) and the embedding end with a sum over
the ranks; the LM head gathers the vocabulary. Splits need not be even (e.g.
SmolLM2's 3 KV heads over 2 ranks: 2 and 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1


_state = TensorParallel()


def set_tensor_parallel(rank: int, size: int):
    """This process's rank of ``size``; layers built afterwards hold their shard."""
    global _state
    if not 0 <= rank < size:
        raise ValueError(f'rank {rank} is not in [0, {size})')
    _state = TensorParallel(rank, size)


def tensor_parallel() -> TensorParallel:
    return _state


def split_range(n: int, rank: int, size: int) -> range:
    """Rank ``rank``'s share of ``n`` items split as evenly as possible (the first ranks take the extra)."""
    return range(n * rank // size, n * (rank + 1) // size)


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> Tuple[range, range]:
    """(query heads, KV heads) that ``rank`` holds; each query head stays with its KV head."""
    if num_heads % num_kv_heads:
        raise ValueError(f'{num_heads} query heads are not a multiple of {num_kv_heads} KV heads')
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv = split_range(num_kv_heads, rank, size)
        return range(kv.start * group, kv.stop * group), kv
    if size % num_kv_heads:
        raise ValueError(f'tp={size} does not split {num_kv_heads} KV heads: with fewer KV heads than ranks, tp must '
                         f'be a multiple of the KV heads')
    replicas = size // num_kv_heads
    if group < replicas:
        raise ValueError(f'tp={size} is more than the {num_heads} query heads can be split over')
    kv_head = rank // replicas
    q = split_range(group, rank % replicas, replicas)
    return range(kv_head * group + q.start, kv_head * group + q.stop), range(kv_head, kv_head + 1)


def check_splits(num_heads: int, num_kv_heads: int, size: int):
    """Raise a clear error at start-up if the model cannot be split over ``size`` ranks."""
    for rank in range(size):
        q, kv = head_shard(num_heads, num_kv_heads, rank, size)
        if not len(q) or not len(kv):
            raise ValueError(f'tp={size}: rank {rank} would hold no attention heads')
