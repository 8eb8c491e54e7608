"""The engine launches step N+1 before it reads back step N's sampled tokens.

Tokens still on the device sit in a sequence as placeholders; these tests
check that the overlap really happens, and that requests which end while
their next step is already in flight (stop token, cancel, interactive turn)
report exactly what a step-by-step engine would, leaking no KV block.
"""
import random

import pytest
from engine_utils import assert_engine_clean, submit
from helpers import hf_greedy

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.sequence import SamplingParams
from lmdeploy.messages import PytorchEngineConfig

NEW = 12


@pytest.fixture
def engine(tiny_model_factory):
    # 512 blocks: room for every request here (the default for a tiny model is millions, whose bookkeeping and
    # invariant checks take about a second an engine)
    eng = Engine(tiny_model_factory('llama'), PytorchEngineConfig(device_type='cpu', block_size=4, session_len=256,
                                                                  num_gpu_blocks=512))
    yield eng
    eng.close()


@pytest.fixture
def prompts():
    rng = random.Random()
    return [[rng.randrange(20, 49152) for _ in range(n)] for n in (7, 13, 4)]


def stop_index(tokens):
    """The last index whose token does not occur before it (a random model
    often loops on one token; index 0 always qualifies): stopping on it
    ends the request exactly there."""
    return max(i for i in range(len(tokens)) if tokens[i] not in tokens[:i])


def test_next_step_is_launched_before_tokens_are_read(engine, prompts, tiny_model_factory):
    launched_ahead = []
    forward = engine.runner.forward

    def spy(batch, prev_tokens=None):
        launched_ahead.append(prev_tokens is not None)
        return forward(batch, prev_tokens)

    engine.runner.forward = spy
    cols = [submit(engine, p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    got = [c.wait().token_ids for c in cols]
    assert got == hf_greedy(tiny_model_factory('llama'), prompts, NEW)
    # every decode step after the first ran while the previous one's tokens were still on the device
    assert sum(launched_ahead) >= NEW - 2


def test_penalised_requests_run_ahead_too(engine, prompts):
    """Penalties, bad words and a bias read the history on the host; the engine settles the previous step
    before sampling, so such requests still launch ahead, and draw what the same engine draws one step at a
    time (nothing in flight)."""
    rng = random.Random()
    settings = [dict(repetition_penalty=1.3, frequency_penalty=0.8),
                dict(presence_penalty=1.5, bad_sequences=[[rng.randrange(20, 49152), rng.randrange(20, 49152)]]),
                dict(logit_bias={rng.randrange(20, 49152): 3.0}, frequency_penalty=-0.5)]

    def run():
        cols = [submit(engine, p, SamplingParams(max_new_tokens=NEW, **kw)) for p, kw in zip(prompts, settings)]
        return [c.wait().token_ids for c in cols]

    launched_ahead = []
    forward = engine.runner.forward

    def spy(batch, prev_tokens=None):
        launched_ahead.append(prev_tokens is not None)
        return forward(batch, prev_tokens)

    engine.runner.forward = spy
    ahead = run()
    assert sum(launched_ahead) >= NEW - 2
    engine.runner.forward = forward
    engine.scheduler.can_run_ahead = lambda: False  # every step's tokens read before the next is scheduled
    assert run() == ahead
    assert_engine_clean(engine)


def test_stop_token_while_next_step_in_flight(engine, prompts, tiny_model_factory):
    ref = hf_greedy(tiny_model_factory('llama'), prompts, NEW)
    i = stop_index(ref[0])
    stopper = submit(engine, prompts[0], SamplingParams(max_new_tokens=NEW, stop_token_ids=[ref[0][i]]))
    others = [submit(engine, p, SamplingParams(max_new_tokens=NEW)) for p in prompts[1:]]
    stopper.wait()
    # the stop token ends the request and is not reported; nothing after it leaks out
    assert stopper.token_ids == ref[0][:i] and stopper.final.finish_reason == 'stop'
    assert [c.wait().token_ids for c in others] == ref[1:]
    assert_engine_clean(engine)


def test_cancel_while_in_flight_frees_everything(engine, prompts):
    cols = [submit(engine, p, SamplingParams(max_new_tokens=200), session_id=900 + k) for k, p in enumerate(prompts)]
    while len(cols[0].token_ids) < 3:
        cols[0].done.wait(0.01)
    engine.cancel(900)
    assert cols[0].wait().final.finish_reason == 'abort'
    for c in cols[1:]:
        assert len(c.wait().token_ids) == 200
    assert_engine_clean(engine)


def test_interactive_turn_that_stops_in_flight_keeps_a_consistent_history(engine, prompts, tiny_model_factory):
    path = tiny_model_factory('llama')
    first = prompts[0]
    ref = hf_greedy(path, [first], NEW)[0]
    i = stop_index(ref)
    stop = ref[i]
    busy = submit(engine, prompts[1], SamplingParams(max_new_tokens=40))  # keeps steps running ahead
    turn1 = submit(engine, first, SamplingParams(max_new_tokens=NEW, stop_token_ids=[stop]), session_id=77,
                   interactive=True).wait()
    assert turn1.token_ids == ref[:i] and turn1.final.finish_reason == 'stop'
    follow = prompts[2]
    turn2 = submit(engine, follow, SamplingParams(max_new_tokens=6), session_id=77, interactive=True).wait()
    # the history holds the prompt, the reply and its stop token, then the new turn
    history = first + ref[:i] + [stop] + follow
    assert turn2.token_ids == hf_greedy(path, [history], 6)[0]
    busy.wait()
    engine.end_session(77)
    assert_engine_clean(engine)


def test_prefill_steps_carry_the_decoding_sequences(tiny_model_factory):
    """Scheduling as on a graph device (decode steps alone, prefill when a
    slot frees): a step that prefills also decodes the running sequences,
    one-token rows first, and their tokens are those of a step-by-step
    reference."""
    eng = Engine(tiny_model_factory('llama'), PytorchEngineConfig(device_type='cpu', block_size=4, session_len=256,
                                                                  max_batch_size=2, num_gpu_blocks=512))
    eng.scheduler.mix = False
    steps = []
    forward = eng.runner.forward

    def spy(batch, prev_tokens=None):
        steps.append(list(batch.num_new_tokens))
        return forward(batch, prev_tokens)

    eng.runner.forward = spy
    rng = random.Random()
    prompts = [[rng.randrange(20, 49152) for _ in range(n)] for n in (9, 5, 14, 6)]
    limits = [3, 11, 4, 7]
    try:
        cols = [submit(eng, p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, limits)]
        got = [c.wait().token_ids for c in cols]
        assert_engine_clean(eng)
    finally:
        eng.close()
    ref = hf_greedy(tiny_model_factory('llama'), prompts, max(limits))
    assert got == [r[:n] for r, n in zip(ref, limits)]
    mixed = [s for s in steps if 1 in s and any(n > 1 for n in s)]
    assert mixed, steps
    assert all(s == sorted(s, key=lambda n: n != 1) for s in mixed)  # one-token rows lead


def test_step_statistics_take_device_time_from_marks(engine, prompts):
    """The host runs a step ahead of the device, so its clock puts one
    step's wait into the next; steps are timed between marks in the
    device's queue instead. A mark the device has not reached yet is
    counted later, without waiting for it."""
    spans = {}  # start mark -> device seconds of the step, once reached
    reached = [True]
    ids = iter(range(10**6))

    def timestamp():
        return next(ids)

    def seconds_between(start, end):
        if not reached[0]:
            return None
        return spans.setdefault(start, random.uniform(0.01, 0.02) * (end - start))

    engine.runtime.timestamp, engine.runtime.seconds_between = timestamp, seconds_between
    try:
        submit(engine, prompts[0], SamplingParams(max_new_tokens=NEW)).wait()
        first = engine.stats().extra
        steps = first['prefill_steps'] + first['decode_steps']
        assert steps >= NEW and len(spans) == steps
        for phase in ('prefill', 'decode'):
            assert first[f'{phase}_device_seconds'] > 0
        assert first['prefill_device_seconds'] + first['decode_device_seconds'] == pytest.approx(sum(spans.values()))

        reached[0] = False  # the device falls behind: nothing is counted, nothing waits
        submit(engine, prompts[1], SamplingParams(max_new_tokens=NEW)).wait()
        behind = engine.stats().extra
        assert behind['decode_steps'] > first['decode_steps']
        assert behind['decode_device_seconds'] == first['decode_device_seconds']
        reached[0] = True
        caught_up = engine.stats().extra
        assert len(spans) == caught_up['prefill_steps'] + caught_up['decode_steps']
        assert caught_up['prefill_device_seconds'] + caught_up['decode_device_seconds'] == pytest.approx(
            sum(spans.values()))
    finally:
        del engine.runtime.timestamp, engine.runtime.seconds_between
