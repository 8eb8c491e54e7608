"""The graph runner's bookkeeping, on a CPU-only machine.

A device that replays recorded steps gets decode steps padded to a
captured batch size, and steps with prompt rows padded to a captured token
count (the decode batch padded with empty rows, the prompt sequences with
empty ones), with inputs copied into static buffers and padding that must
write nothing. A cpu device stands in for one (tests/graph_emulation.py):
its "graph" re-runs the recorded function on the same static buffers and
rewrites the same output tensor, which is what a replay promises. Tokens
must equal transformers' step by step, whatever the padding.
"""
import random
import time

import pytest
from engine_utils import assert_engine_clean, submit
from graph_emulation import ReplayingCpu
from helpers import hf_greedy

import lmdeploy.engine.engine as engine_module
from lmdeploy.engine.engine import Engine
import lmdeploy.engine.graph_runner as graph_runner
from lmdeploy.engine.graph_runner import GraphRunner, capture_sizes, token_buckets
from lmdeploy.engine.sequence import SamplingParams
from lmdeploy.messages import PytorchEngineConfig


@pytest.fixture
def replaying(monkeypatch):
    device = ReplayingCpu()
    monkeypatch.setattr(engine_module, 'get_device', lambda device_type='auto': device)
    return device


def test_token_buckets():
    sizes = token_buckets(2048)
    assert sizes[:3] == [16, 32, 48] and sizes[-1] == 2048 and sizes == sorted(set(sizes))
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:]) if b <= 512)  # little padding where steps are small
    assert all(b - a <= 64 for a, b in zip(sizes, sizes[1:])) and len(sizes) == 64
    assert token_buckets(72) == [16, 32, 48, 64, 72]
    assert token_buckets(10) == [10]


def assert_transformers_tokens(model, prompts, limits, got):
    ref = hf_greedy(model, prompts, max(limits))
    assert got == [r[:n] for r, n in zip(ref, limits)]


def _config(**kw):
    # unless a test sets it: 512 blocks, room for every request here (the default for a tiny model is millions,
    # whose bookkeeping and invariant checks take about a second an engine)
    kw['num_gpu_blocks'] = kw.get('num_gpu_blocks') or 512
    return PytorchEngineConfig(device_type='cpu', block_size=4, session_len=128, max_batch_size=8,
                               max_prefill_token_num=32, **kw)


@pytest.mark.parametrize('num_prompts,num_blocks', [(3, 0), (5, 0), (14, 36)])
def test_padded_replays_give_transformers_tokens(tiny_model_factory, replaying, num_prompts, num_blocks):
    """(14 prompts in a batch of 8 and a small cache: finished sequences' blocks
    go to new ones while a padding row may still hold an old slot.)"""
    model = tiny_model_factory('llama')
    eng = Engine(model, _config(num_gpu_blocks=num_blocks))
    try:
        assert sorted(replaying.captured) == sorted(capture_sizes(8) + token_buckets(40))
        assert capture_sizes(8) == [1, 2, 4, 8] and token_buckets(40) == [16, 32, 40]
        rng = random.Random()
        prompts = [[rng.randrange(20, 49152) for _ in range(rng.randint(3, 17))] for _ in range(num_prompts)]
        limits = [rng.randint(4, 12) for _ in prompts]
        cols = [submit(eng, p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, limits)]
        got = [c.wait().token_ids for c in cols]
        assert_engine_clean(eng)
    finally:
        eng.close()
    assert_transformers_tokens(model, prompts, limits, got)
    # decode steps replayed, at padded sizes as the batch shrank (3 -> 4, 5 -> 8, then 2, 1 ...)
    assert replaying.replays >= max(limits) - 2


@pytest.mark.parametrize('name', ['llama', 'qwen3'])
def test_mixed_steps_replayed_whole_give_transformers_tokens(tiny_model_factory, replaying, monkeypatch, name):
    """Prompts arrive while others decode: their steps (one-token rows and prompt chunks, chunked at 32
    tokens) replay a recording of a padded token count; a step with more prompt sequences than a
    recording holds (2 here) runs eagerly. Either way the tokens are transformers'."""
    model = tiny_model_factory(name)
    seen = {'mixed': [], 'eager': []}  # (tokens, one-token rows) of each step with prompt rows
    mixed = GraphRunner._mixed
    monkeypatch.setattr(graph_runner, 'mixed_prompt_slots', lambda n: 2)

    def spy(self, input_ids, positions, ctx):
        seen['mixed'].append((input_ids.shape[0], ctx.num_decode))
        return mixed(self, input_ids, positions, ctx)
    monkeypatch.setattr(GraphRunner, '_mixed', spy)
    eng = Engine(model, _config())
    # the burst must make one step past the recordings: no cap on steps that carry decode rows (the cap and
    # its lift are test_scheduler.py's), which would split it into recorded steps or not, by timing
    eng.scheduler.mixed_step_limit = None
    forward = eng.runner._eager_forward

    def eager_spy(input_ids, positions, ctx):  # (recordings call the forward they were made with)
        if not ctx.is_decode:
            seen['eager'].append((input_ids.shape[0], ctx.num_decode))
        return forward(input_ids, positions, ctx)
    eng.runner._eager_forward = eager_spy
    try:
        rng = random.Random()
        prompts = [[rng.randrange(20, 1000) for _ in range(rng.randint(2, 40))] for _ in range(10)]
        # ... and a burst of short prompts, more than a recording's prompt slots
        prompts += [[rng.randrange(20, 1000) for _ in range(rng.randint(2, 6))] for _ in range(5)]
        limits = [rng.randint(3, 10) for _ in prompts]
        cols = []
        for p, n in zip(prompts[:10], limits):
            cols.append(submit(eng, p, SamplingParams(max_new_tokens=n)))
            cols[0].done.wait(0.05)  # staggered arrivals
        # room in the batch (8 sequences at most) for the burst, so that one step takes 3+ of its prompts:
        # every earlier prompt prefilled (a request still in the engine's inbox counts nowhere in its stats;
        # one that reached the engine late would take the burst's slots) and at most 3 still decoding
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = eng.stats()
            if all(c.token_ids for c in cols) and stats.num_running + stats.num_waiting <= 3:
                break
            time.sleep(0.005)
        with eng._lock:  # the burst reaches the engine in one pass of its loop
            cols += [submit(eng, p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts[10:], limits[10:])]
        got = [c.wait().token_ids for c in cols]
        assert_engine_clean(eng)
    finally:
        eng.close()
    assert_transformers_tokens(model, prompts, limits, got)
    assert any(nd > 0 for _, nd in seen['mixed']), seen  # decode rows rode along with prompt rows
    assert {t for t, _ in seen['mixed']} - {16, 32, 40}, seen  # steps were padded to a recording
    assert seen['eager'], seen  # the burst


def test_replayed_and_eager_decode_rows_give_attention_the_same_index_types(tiny_model_factory, replaying,
                                                                           monkeypatch):
    """Decode rows reach the decode-attention kernel from recorded steps
    (decode and mixed) and from eager ones (eager mode, or a step that fits
    no recording); an index tensor of another type (the longest-first order
    was int32 in the graphs, int64 in eager steps) makes Triton compile that
    kernel again, mid-run."""
    seen = {'replay': set(), 'eager': set()}
    in_graph = [False]
    attend = replaying.paged_decode_attention

    def spy(q, cache, block_tables, kv_seqlens, scale, max_kv_len, order=None, out=None):
        seen['replay' if in_graph[0] else 'eager'].add(
            (block_tables.dtype, kv_seqlens.dtype, order.dtype if order is not None else None))
        return attend(q, cache, block_tables, kv_seqlens, scale, max_kv_len, order, out)

    def in_graphs(fn):
        def run(*a):
            in_graph[0] = True
            try:
                return fn(*a)
            finally:
                in_graph[0] = False
        return run

    monkeypatch.setattr(replaying, 'paged_decode_attention', spy)  # (the layers hold the engine's device)
    capture = replaying.capture_graph
    replaying.capture_graph = lambda fn, pool=None: capture(in_graphs(fn), pool)
    for eager in (False, True):
        eng = Engine(tiny_model_factory('llama'), _config(eager_mode=eager))
        try:
            cols = [submit(eng, p, SamplingParams(max_new_tokens=n)) for p, n in (([30, 31, 32], 9), ([40] * 7, 3),
                                                                                ([50] * 5, 4))]
            [c.wait() for c in cols]
            assert_engine_clean(eng)
        finally:
            eng.close()
    assert seen['eager'] and seen['replay'], seen
    assert seen['eager'] == seen['replay']
