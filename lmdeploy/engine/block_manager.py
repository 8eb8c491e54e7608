"""Paged KV cache bookkeeping, with optional prefix caching.

A block is either free (reference count 0) or owned by the sequences whose
block tables list it (count = number of owners). With prefix caching, a
full block is keyed by its tokens and the key of the block before it (so the
key fixes its position too); a freed keyed block stays findable until it is
evicted, least recently used first, when fresh blocks are needed.
Without prefix caching, only the callers that say ``shared=True`` (the n
samples of one prompt) key and match blocks.

A block table may hold :data:`FREED` in place of leading blocks that no later
query of its sequence sees (every layer's sliding window is past them): the
scheduler gives such blocks back early, and the table keeps each token's
block at index position // block_size.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

BlockKey = Tuple[int, Tuple[int, ...]]
FREED = -1  # a block table's entry for a block given back (behind a sliding window); attention never reads it


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f'the KV cache needs at least one block, got {num_blocks}')
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: deque = deque(range(num_blocks))  # unkeyed, count 0
        self._evictable: OrderedDict = OrderedDict()  # keyed, count 0, LRU first
        self._by_key: Dict[Hashable, int] = {}
        self._key_of: Dict[int, Hashable] = {}
        self.num_prefix_hits = 0  # tokens served from the cache (a statistic)

    # ----------------------------------------------------------------- sizes
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ allocation
    def allocate(self, n: int) -> List[int]:
        if n > self.num_free:
            raise RuntimeError(f'asked for {n} KV blocks, {self.num_free} free')
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._by_key[self._key_of.pop(block)]
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[int]):
        # release in reverse so a sequence's tail blocks are evicted before its head
        for block in reversed(list(blocks)):
            if block == FREED:
                continue
            count = self.ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f'KV block {block} freed twice')
            self.ref_counts[block] = count
            if count == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # --------------------------------------------------------- prefix cache
    @staticmethod
    def key(parent: Optional[Hashable], tokens: Sequence[int]) -> BlockKey:
        return (hash(parent), tuple(tokens))

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int,
                     shared: bool = False) -> Tuple[List[int], List[Hashable]]:
        """Take references on cached blocks that hold a prefix of
        ``token_ids`` no longer than ``max_tokens``."""
        if not (self.prefix_caching or shared):
            return [], []
        blocks, keys, parent = [], [], None
        bs = self.block_size
        for start in range(0, max_tokens - bs + 1, bs):
            key = self.key(parent, token_ids[start:start + bs])
            block = self._by_key.get(key)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1
            blocks.append(block)
            keys.append(key)
            parent = key
        self.num_prefix_hits += len(blocks) * bs
        return blocks, keys

    def register_full_blocks(self, token_ids: Sequence[int], num_computed: int, block_ids: List[int],
                             block_keys: List[Hashable], shared: bool = False):
        """Key the sequence's newly completed blocks (extends ``block_keys``)."""
        if not (self.prefix_caching or shared):
            return
        bs = self.block_size
        while len(block_keys) < num_computed // bs:
            i = len(block_keys)
            parent = block_keys[-1] if block_keys else None
            key = self.key(parent, token_ids[i * bs:(i + 1) * bs])
            block_keys.append(key)
            block = block_ids[i]
            if block != FREED and key not in self._by_key and block not in self._key_of:
                self._by_key[key] = block
                self._key_of[block] = key

    # ------------------------------------------------------------- checking
    def check_invariants(self, owners: Iterable[Sequence[int]]):
        """Raise AssertionError unless counts match the given block tables."""
        counts = [0] * self.num_blocks
        for table in owners:
            for block in table:
                if block != FREED:
                    counts[block] += 1
        assert counts == self.ref_counts, 'reference counts disagree with the block tables'
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), 'a block is free twice'
        assert not (free & evictable), 'a block is both free and evictable'
        for block in range(self.num_blocks):
            idle = block in free or block in evictable
            assert idle == (counts[block] == 0), f'block {block}: free-list membership disagrees with its count'
            assert (block in evictable) <= (block in self._key_of), f'evictable block {block} has no key'
            assert (block in free) <= (block not in self._key_of), f'free block {block} still has a key'
        for key, block in self._by_key.items():
            assert self._key_of.get(block) == key, 'prefix-cache maps disagree'
        assert len(self._by_key) == len(self._key_of)
