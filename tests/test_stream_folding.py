"""A server that falls behind the engine folds what piled up into one increment (gateway.take_pending for the
engine's outputs, the run queue for a request's increments) and keeps the per-token metrics cheap: the folded
result is exactly what the outputs one by one would have given."""
import asyncio
import random
from collections import deque

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from lmdeploy.engine.sequence import EngineOutput
from lmdeploy.frontend.gateway import GenOut, take_pending
from lmdeploy.serve.openai.jobs import Run
from lmdeploy.serve.openai.metrics import _TokenHistogram


def _outputs(rng, n, with_logprobs):
    outs = []
    for i in range(n):
        ids = [rng.randrange(50000) for _ in range(rng.randint(1, 3))]
        lps = [{t: -rng.random()} for t in ids] if with_logprobs else None
        outs.append(EngineOutput(ids, num_prompt_tokens=17, logprobs=lps))
    outs[-1].finished, outs[-1].finish_reason = True, rng.choice(['stop', 'length'])
    return outs


def test_take_pending_folds_everything_queued_up_to_the_last_output():
    rng = random.Random()

    async def go(with_logprobs):
        outs = _outputs(rng, rng.randint(3, 9), with_logprobs)
        q = asyncio.Queue()
        for o in outs[1:]:
            q.put_nowait(o)
        extra = EngineOutput([1], num_prompt_tokens=17)  # another request's turn would never follow a last one
        q.put_nowait(extra)
        got = take_pending(outs[0], q)
        assert got.new_token_ids == [t for o in outs for t in o.new_token_ids]
        assert (got.finished, got.finish_reason, got.num_prompt_tokens) == (True, outs[-1].finish_reason, 17)
        if with_logprobs:
            assert got.logprobs == [lp for o in outs for lp in o.logprobs]
        else:
            assert got.logprobs is None
        assert q.qsize() == 1 and q.get_nowait() is extra  # nothing past the last output was taken
        alone = EngineOutput([5, 6])
        assert take_pending(alone, asyncio.Queue()) is alone  # nothing queued: no copy

    asyncio.run(go(False))
    asyncio.run(go(True))


def test_the_run_queue_folds_a_jobs_increments_in_order():
    """Two jobs' increments interleaved in the queue: only consecutive ones of one job fold, a job's end
    (None) and the last increment (finish_reason) are never folded past, and the text comes out whole."""
    rng = random.Random()

    async def go():
        run = Run.__new__(Run)
        run.queue, run._ready, run._ended = deque(), asyncio.Event(), set()
        items = []
        for job in (0, 1):
            for k in range(rng.randint(2, 6)):
                items.append((job, GenOut(f'j{job}t{k} ', 5, k + 1, token_ids=[k])))
            items[-1][1].finish_reason = 'length'
        wants = {j: (''.join(o.text for i, o in items if i == j), sum(1 for i, _ in items if i == j)) for j in (0, 1)}
        order = [0, 0, 1, 1, 1, 0] if len(items) >= 6 else [i for i, _ in items]
        by_job = {j: deque(o for i, o in items if i == j) for j in (0, 1)}
        for j in order + [0] * 12 + [1] * 12:
            if by_job[j]:
                run._put(j, by_job[j].popleft())
        run._put(0, None)
        run._put(1, None)
        texts, finished, seen = {0: '', 1: ''}, {}, []
        while run.queue:
            j, out = await run._get()
            seen.append(j)
            if out is None:
                continue
            assert j not in finished, 'nothing follows a last increment'
            texts[j] += out.text
            if out.finish_reason:
                finished[j] = out.generate_token_len
        for j in (0, 1):  # (folding changed the queued objects in place: compare with the texts before)
            assert (texts[j], finished[j]) == wants[j]
        assert len(seen) < len(items) + 2  # something was folded

    asyncio.run(go())


def test_token_histogram_matches_prometheus():
    rng = random.Random()
    bounds = sorted(rng.sample([0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5], 4))
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h = _TokenHistogram('tpot_seconds', 'doc', bounds)
    ours.register(h)
    ref = Histogram('tpot_seconds', 'doc', buckets=bounds, registry=theirs)
    for _ in range(300):
        value, n = rng.choice(bounds + [rng.random() * 0.2]), rng.randint(1, 4)
        h.observe(value, n)
        for _ in range(n):
            ref.observe(value)

    def lines(reg):
        return {line.rsplit(' ', 1)[0]: float(line.rsplit(' ', 1)[1]) for line in generate_latest(reg).decode().splitlines()
                if line.startswith('tpot_seconds_')}
    a, b = lines(ours), lines(theirs)
    b.pop('tpot_seconds_created', None)
    assert a.keys() == b.keys()
    for k in a:
        assert abs(a[k] - b[k]) <= 1e-9 * max(1.0, abs(b[k])), k
