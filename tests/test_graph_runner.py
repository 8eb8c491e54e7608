"""The graph runner's bookkeeping, on a CPU-only machine.

A device that replays recorded decode steps gets them padded to a captured
batch size, with inputs copied into static buffers and padding rows that
must write nothing. Here a cpu device stands in for one: its "graph" re-runs
the recorded function on the same static buffers and rewrites the same
output tensor, which is what a replay promises. Tokens must equal
transformers' step by step, whatever the padding.
"""
import random

import pytest
from engine_utils import assert_engine_clean, submit
from helpers import hf_greedy

import lmdeploy.engine.engine as engine_module
from lmdeploy.devices import ops
from lmdeploy.devices.cpu import CpuOps
from lmdeploy.engine.engine import Engine
from lmdeploy.engine.graph_runner import capture_sizes
from lmdeploy.engine.sequence import SamplingParams
from lmdeploy.messages import PytorchEngineConfig


class ReplayingCpu(CpuOps):
    """The cpu device with "graphs": a capture records the function and its
    output tensor; a replay runs the function again and writes the result
    into that tensor."""
    supports_graphs = True

    def __init__(self):
        super().__init__()
        self.captured, self.replays = [], 0

    def capture_graph(self, fn, pool=None):
        out = fn()
        self.captured.append(out.shape[0])

        def replay():
            self.replays += 1
            out.copy_(fn())
        return replay, out, pool


@pytest.fixture
def replaying(monkeypatch):
    device = ReplayingCpu()
    monkeypatch.setattr(engine_module, 'get_device', lambda device_type='auto': device)
    return device


@pytest.mark.parametrize('num_prompts,num_blocks', [(3, 0), (5, 0), (14, 36)])
def test_padded_replays_give_transformers_tokens(tiny_model_factory, replaying, num_prompts, num_blocks):
    """(14 prompts in a batch of 8 and a small cache: finished sequences' blocks
    go to new ones while a padding row may still hold an old slot.)"""
    model = tiny_model_factory('llama')
    eng = Engine(model, PytorchEngineConfig(device_type='cpu', block_size=4, session_len=128, max_batch_size=8,
                                            num_gpu_blocks=num_blocks))
    try:
        assert sorted(replaying.captured) == capture_sizes(8) == [1, 2, 4, 8]
        rng = random.Random()
        prompts = [[rng.randrange(20, 49152) for _ in range(rng.randint(3, 17))] for _ in range(num_prompts)]
        limits = [rng.randint(4, 12) for _ in prompts]
        cols = [submit(eng, p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, limits)]
        got = [c.wait().token_ids for c in cols]
        assert_engine_clean(eng)
    finally:
        eng.close()
    ref = hf_greedy(model, prompts, max(limits))
    assert got == [r[:n] for r, n in zip(ref, limits)]
    # decode steps replayed, at padded sizes as the batch shrank (3 -> 4, 5 -> 8, then 2, 1 ...)
    assert replaying.replays >= max(limits) - 2


def test_replayed_and_eager_decode_rows_give_attention_the_same_index_types(tiny_model_factory, replaying,
                                                                           monkeypatch):
    """A prefill step's decode rows run eagerly through the decode-attention
    kernel the graphs were captured with; an index tensor of another type
    (the longest-first order was int32 in the graphs, int64 in eager steps)
    makes Triton compile that kernel again, mid-run."""
    seen = {'replay': set(), 'eager': set()}
    in_graph = [False]
    attend = ops.paged_decode_attention

    def spy(q, k_cache, v_cache, block_tables, kv_seqlens, scale, max_kv_len, order=None):
        seen['replay' if in_graph[0] else 'eager'].add(
            (block_tables.dtype, kv_seqlens.dtype, order.dtype if order is not None else None))
        return attend(q, k_cache, v_cache, block_tables, kv_seqlens, scale, max_kv_len, order)

    def in_graphs(fn):
        def run(*a):
            in_graph[0] = True
            try:
                return fn(*a)
            finally:
                in_graph[0] = False
        return run

    monkeypatch.setattr(ops, 'paged_decode_attention', spy)
    capture = replaying.capture_graph
    replaying.capture_graph = lambda fn, pool=None: capture(in_graphs(fn), pool)
    eng = Engine(tiny_model_factory('llama'), PytorchEngineConfig(device_type='cpu', block_size=4, session_len=128,
                                                                  max_batch_size=2))
    try:
        cols = [submit(eng, p, SamplingParams(max_new_tokens=n)) for p, n in (([30, 31, 32], 9), ([40] * 7, 3),
                                                                            ([50] * 5, 4))]
        [c.wait() for c in cols]
        assert_engine_clean(eng)
    finally:
        eng.close()
    assert seen['eager'] and seen['replay'], seen  # a prefill step carried decode rows
    assert seen['eager'] == seen['replay']
