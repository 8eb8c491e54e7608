"""When a graph device's scheduler refills the batch: decode steps run alone
(they replay recorded graphs), and a prefill step, which carries every
decoding sequence along (one-token rows first), comes once ``refill_slots``
slots are free or after ``prefill_interval`` decode steps."""
import random

import pytest

from lmdeploy.engine.block_manager import BlockManager
from lmdeploy.engine.scheduler import Scheduler
from lmdeploy.engine.sequence import SamplingParams, Sequence


def make(max_batch_size, waiting, prefill_interval=1000):
    sched = Scheduler(BlockManager(4096, 16), max_batch_size, 4096, lambda seq, why: None, mix_prefill_decode=False,
                      prefill_interval=prefill_interval)
    rng = random.Random()
    for i in range(waiting):
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(2, 40))]
        sched.add(Sequence(i, i, prompt, SamplingParams(max_new_tokens=10**6), lambda out: None, 10**6))
    return sched


def step(sched):
    """Schedule, then run the batch as the engine would (a token sampled, at once known)."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed += n
        if seq.num_pending == 0:
            seq.token_ids.append(7)
            seq.num_generated += 1
    return batch


def finish(sched, n):
    for seq in sched.running[:n]:
        sched.remove(seq)


def test_refill_waits_for_enough_free_slots_then_carries_the_decoding_sequences():
    assert make(256, 0).refill_slots == 8 and make(16, 0).refill_slots == 1  # a 32nd of the batch, at least 1
    sched = make(16, 40)
    sched.refill_slots = 2
    first = step(sched)
    assert len(first.seqs) == 16 and not first.is_decode
    for _ in range(3):
        assert step(sched).is_decode
    finish(sched, 1)
    assert step(sched).is_decode  # one free slot: not yet
    finish(sched, 1)
    refill = step(sched)  # two free: the waiting fill them, the 14 decoding ride along, first
    assert refill.num_new_tokens[:14] == [1] * 14 and all(n > 1 for n in refill.num_new_tokens[14:])
    assert len(refill.seqs) == 16
    sched.refill_slots = 1
    assert step(sched).is_decode
    finish(sched, 1)
    assert not step(sched).is_decode


def test_a_full_batch_still_admits_after_prefill_interval_steps():
    sched = make(16, 40, prefill_interval=4)
    step(sched)
    for _ in range(4):
        assert step(sched).is_decode
    # the batch is full: the prefill step admits nobody and runs as a plain decode step
    assert step(sched).is_decode and len(sched.running) == 16
    finish(sched, 1)
    refill = step(sched)  # the interval has passed: one free slot is enough
    assert not refill.is_decode and refill.num_new_tokens[:15] == [1] * 15


def test_a_burst_of_prompts_is_spread_over_steps_within_the_recorded_limit():
    """With decode rows in the step, prompt tokens and prompt sequences stay within ``mixed_step_limit`` (the
    largest recorded step), the prompts chunked over several steps; a step without decode rows takes the whole
    prefill budget. Every prompt is prefilled exactly once, in order."""
    rng = random.Random()
    limit_tokens, limit_prompts = rng.choice([(48, 3), (64, 2), (100, 4)])
    sched = Scheduler(BlockManager(4096, 16), 64, 512, lambda seq, why: None, mix_prefill_decode=False,
                      mixed_step_limit=(limit_tokens, limit_prompts))
    sched.refill_slots = 1
    sched.backlog_steps = 10**9  # the limit alone (a lasting backlog lifts it: the next test)
    lengths = [rng.randint(2, 120) for _ in range(30)]
    for i, n in enumerate(lengths[:4]):
        sched.add(Sequence(i, i, [rng.randrange(10, 1000) for _ in range(n)], SamplingParams(max_new_tokens=10**6),
                           lambda out: None, 10**6))
    first = step(sched)  # nothing decodes yet: the whole budget
    assert not any(n == 1 for n in first.num_new_tokens) and sum(first.num_new_tokens) == sum(lengths[:4])
    for i, n in enumerate(lengths[4:], start=4):  # the burst, while four sequences decode
        sched.add(Sequence(i, i, [rng.randrange(10, 1000) for _ in range(n)], SamplingParams(max_new_tokens=10**6),
                           lambda out: None, 10**6))
    prefilled = {}
    for _ in range(200):
        if not sched.waiting and all(s.num_generated > 0 for s in sched.running):  # every prompt prefilled
            break
        batch = sched.schedule()
        rows = list(zip(batch.seqs, batch.num_new_tokens))
        decode_rows = sum(1 for s, n in rows if s.num_generated > 0)  # (read before the step is run)
        prompt_rows = [(s, n) for s, n in rows if s.num_generated == 0]
        # what the limit counts: rows of several tokens (a prompt whose last token alone is left runs as a
        # one-token row, in the step's decode batch, as a recorded step does)
        multi_rows = [(s, n) for s, n in rows if n > 1 or s.num_pending > 1]
        for seq, n in rows:  # run it, as step() does
            seq.num_computed += n
            if seq.num_pending == 0:
                seq.token_ids.append(7)
                seq.num_generated += 1
        assert decode_rows >= 4
        assert len(batch.seqs) <= limit_tokens and len(multi_rows) <= limit_prompts
        assert sum(batch.num_new_tokens) <= limit_tokens
        for s, n in prompt_rows:
            prefilled[s.seq_id] = prefilled.get(s.seq_id, 0) + n
    assert prefilled == {i: n for i, n in enumerate(lengths) if i >= 4}


def test_a_lasting_backlog_lifts_the_limit_and_a_cleared_one_restores_it():
    """Prompts still waiting after ``backlog_steps`` steps in a row: steps take the whole prefill budget
    (larger steps prefill more tokens a second under sustained load); once nothing waits, the limit is back."""
    rng = random.Random()
    sched = Scheduler(BlockManager(8192, 16), 64, 512, lambda seq, why: None, mix_prefill_decode=False,
                      mixed_step_limit=(64, 4))
    sched.refill_slots = 1
    add = lambda i, n: sched.add(Sequence(i, i, [rng.randrange(10, 1000) for _ in range(n)],  # noqa: E731
                                          SamplingParams(max_new_tokens=10**6), lambda out: None, 10**6))
    for i in range(2):
        add(i, 8)
    step(sched)  # two sequences decode from now on
    for i in range(2, 40):
        add(i, rng.randint(40, 120))
    sizes = [sum(step(sched).num_new_tokens) for _ in range(sched.backlog_steps)]
    assert max(sizes) <= 64  # a burst first: within the limit
    lifted = step(sched)
    assert sum(lifted.num_new_tokens) > 64 and sum(n for n in lifted.num_new_tokens if n > 1) <= 512
    for _ in range(100):
        if not sched.waiting and all(s.num_pending == 1 for s in sched.running):
            break
        step(sched)
    step(sched)  # nothing waits any more
    add(99, 200)
    assert sum(step(sched).num_new_tokens) <= 64  # the limit again


def _serve_long_prompts(window, old_admission=False):
    """60 prompts of 1,200-1,800 tokens, all waiting at once on a cache of 6,400 tokens (about four prompts
    without a window, about twenty windows of 256); run to the end as the engine does. Outputs: 8-16 tokens
    without a window (at most one block of growth: the block each running sequence is kept, so that what
    is measured is admission, not decode growth), 100-150 with one (a window's blocks do not grow).
    Returns (tokens computed, the tokens that had to be, preemptions, most sequences decoding at once)."""
    rng = random.Random()
    bm = BlockManager(400, 16)
    sched = Scheduler(bm, 64, 512, lambda seq, why: pytest.fail(why), kv_window=window)
    if old_admission:  # admit whatever the first chunk fits (what the scheduler did before)
        sched._headroom = lambda: 10**9
    outs, needed = {}, 0
    for i in range(60):
        seq = Sequence(i, i, [rng.randrange(10, 1000) for _ in range(rng.randint(1200, 1800))],
                       SamplingParams(max_new_tokens=10**6), lambda out: None, 10**6)
        outs[i] = rng.randint(8, 16) if window is None else rng.randint(100, 150)
        needed += seq.num_tokens + outs[i] - 1  # the last token is sampled, never computed
        sched.add(seq)
    computed = most = 0
    for _ in range(20000):
        if not sched.has_work():
            break
        batch = sched.schedule()
        sched.postprocess(batch)
        computed += sum(batch.num_new_tokens)
        most = max(most, sum(1 for s in sched.running if s.num_pending <= 1))
        for seq in batch.seqs:
            if seq.num_pending == 0:
                seq.token_ids.append(rng.randrange(10, 1000))
                seq.num_generated += 1
                if seq.num_generated == outs[seq.seq_id]:
                    sched.finish(seq)
        sched.check_invariants()
    assert not sched.has_work() and bm.num_used == 0
    return computed, needed, sched.num_preemptions, most


@pytest.mark.parametrize('window', [None, 256])
def test_long_prompts_under_a_full_cache_are_admitted_only_when_they_can_finish(window):
    """A prompt is admitted only while the cache can hold all of it (or its window) beside what the running
    prompts still need: nothing is preempted, nothing computed twice. The old admission (whatever the first
    chunk fits) preempts and recomputes on the same load, so the check is what prevents it. With a window
    the cache holds many more sequences at once."""
    computed, needed, preemptions, most = _serve_long_prompts(window)
    assert preemptions == 0 and computed == needed
    old_computed, _, old_preemptions, _ = _serve_long_prompts(window, old_admission=True)
    assert old_preemptions > 0 and old_computed > needed
    if window is None:
        assert most <= 5  # 400 blocks hold four or five of these prompts
    else:
        assert most >= 12  # 17 blocks a sequence once past its prompt
