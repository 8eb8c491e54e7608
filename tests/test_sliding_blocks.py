"""Blocks behind every layer's sliding window are given back (scheduler._slide): a sequence holds about a
window of KV blocks however long it grows, the table keeps each token's block at index position // block_size
(FREED where given back), counts stay consistent, and freed keyed blocks stay findable by the prefix cache."""
import random

import pytest

from lmdeploy.engine.block_manager import FREED, BlockManager
from lmdeploy.engine.scheduler import Scheduler
from lmdeploy.engine.sequence import SamplingParams, Sequence


def run(sched, steps):
    """Schedule, launch (postprocess) and sample, as the engine does, checking the invariants each step."""
    for _ in range(steps):
        batch = sched.schedule()
        sched.postprocess(batch)
        for seq in batch.seqs:
            if seq.num_pending == 0:
                seq.token_ids.append(random.randrange(10, 1000))
                seq.num_generated += 1
        sched.check_invariants()
        yield batch


@pytest.mark.parametrize('window,block_size,chunk', [(6, 4, 5), (16, 16, 64), (1, 4, 3), (33, 8, 8)])
def test_a_sequence_holds_about_a_window_of_blocks(window, block_size, chunk):
    bm = BlockManager(64, block_size)
    sched = Scheduler(bm, 4, chunk, lambda seq, why: pytest.fail(why), kv_window=window)
    prompt = [random.randrange(10, 1000) for _ in range(random.randint(40, 120))]
    seq = Sequence(0, 0, prompt, SamplingParams(max_new_tokens=10**6), lambda out: None, 10**6)
    sched.add(seq)
    bound = bm.blocks_for(window + 2 * chunk) + 2
    for _ in run(sched, 150):
        live = [b for b in seq.block_ids if b != FREED]
        assert bm.num_used == len(live) <= bound
        assert len(seq.block_ids) == bm.blocks_for(seq.num_computed)  # positions keep their index
        # freed: a prefix, every block wholly at or before (the last step's first query) - window
        first_live = next(i for i, b in enumerate(seq.block_ids) if b != FREED)
        assert all(b == FREED for b in seq.block_ids[:first_live])
        assert first_live * block_size <= max(0, seq.num_computed - window) + block_size
        # and nothing a later query sees (positions above num_computed - window) is given back
        assert first_live <= max(0, seq.num_computed - window + 1) // block_size
    assert seq.num_computed > 100 and bm.blocks_for(seq.num_computed) > bound  # it did outgrow the bound
    sched.remove(seq)
    assert bm.num_used == 0
    sched.check_invariants()


def test_no_window_keeps_every_block():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 4, 8, lambda seq, why: pytest.fail(why))
    seq = Sequence(0, 0, list(range(10, 50)), SamplingParams(max_new_tokens=10**6), lambda out: None, 10**6)
    sched.add(seq)
    for _ in run(sched, 30):
        assert FREED not in seq.block_ids and bm.num_used == len(seq.block_ids)


def test_a_prompt_longer_than_the_cache_is_admitted_when_the_window_fits():
    """Without a window a 200-token prompt cannot fit 20 blocks of 4; with one it streams through them."""
    refused = []
    for window in (None, 8):
        bm = BlockManager(20, 4)
        sched = Scheduler(bm, 4, 4, lambda seq, why: refused.append(why), kv_window=window)
        seq = Sequence(0, 0, list(range(10, 210)), SamplingParams(max_new_tokens=10**6), lambda out: None, 10**6)
        sched.add(seq)
        list(run(sched, 60))
        assert (seq.num_computed == 0) == (window is None)
    assert len(refused) == 1 and 'KV blocks' in refused[0]
    assert seq.num_computed >= 200


def test_freed_keyed_blocks_serve_a_later_prompt():
    """With prefix caching a block given back keeps its key (evictable): the same prompt later matches it."""
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, 4, 8, lambda seq, why: pytest.fail(why), kv_window=6)
    prompt = [random.randrange(10, 1000) for _ in range(41)]
    first = Sequence(0, 0, prompt, SamplingParams(max_new_tokens=10**6), lambda out: None, 10**6)
    sched.add(first)
    list(run(sched, 8))
    assert first.block_ids[0] == FREED
    second = Sequence(1, 1, list(prompt), SamplingParams(max_new_tokens=10**6), lambda out: None, 10**6)
    sched.add(second)
    next(run(sched, 1))
    assert bm.num_prefix_hits >= 36  # nine full blocks of the 40 tokens before the last
