"""Load: 200 concurrent streaming requests against the real server; a random
third of the clients go away early (some before the first token, some
mid-stream). Every other stream completes with the right text and usage;
afterwards nothing runs, no KV block is leaked, and /metrics agrees."""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

httpx = pytest.importorskip('httpx')
pytest.importorskip('openai')  # test_server's dependencies

from test_server import KEY, MODEL, assert_clean, metric, start_server, stop_server  # noqa: E402

NUM_REQUESTS = 200
MAX_TOKENS = 8
TIMEOUT_S = 200  # bounded: a stuck request fails the test instead of hanging it
PROMPTS = [f'{k}, {k + 1}, {k + 2}, {k + 3},' for k in range(10)]


@pytest.fixture(scope='module')
def srv(smollm2_path):
    s = start_server(smollm2_path)
    yield s
    stop_server(s)


def _body(prompt: str) -> dict:
    return dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stream=True,
                stream_options={'include_usage': True})


async def _stream(client, prompt: str, drop_after_chunks=None):
    """-> (text, usage, saw_done, finish_reasons); stops reading (closing the
    connection) after ``drop_after_chunks`` text chunks."""
    text, usage, done, reasons, chunks = '', None, False, [], 0
    async with client.stream('POST', '/v1/completions', json=_body(prompt)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith('data: '):
                continue
            data = line[len('data: '):]
            if data == '[DONE]':
                done = True
                break
            obj = json.loads(data)
            assert 'error' not in obj, obj
            if obj.get('usage'):
                usage = obj['usage']
            for c in obj['choices']:
                text += c['text']
                if c['finish_reason']:
                    reasons.append(c['finish_reason'])
                chunks += 1
            if drop_after_chunks is not None and chunks >= drop_after_chunks:
                return text, usage, False, reasons  # leaving the block closes the connection
    return text, usage, done, reasons


def test_load_200_streams_with_disconnects(srv):
    tok = srv.gateway.tokenizer
    headers = {'Authorization': f'Bearer {KEY}'}
    # the expected greedy texts, one request at a time
    with httpx.Client(base_url=srv.url, headers=headers, timeout=60) as c:
        expected = {}
        for p in PROMPTS:
            r = c.post('/v1/completions', json={**_body(p), 'stream': False, 'stream_options': None})
            assert r.status_code == 200, r.text
            expected[p] = r.json()['choices'][0]['text']
    rng = random.Random(1234)
    dropped = set(rng.sample(range(NUM_REQUESTS), NUM_REQUESTS // 3))
    # how a dropping client leaves: before any token (cancelled while waiting), or after 1-3 chunks
    plans = {i: rng.choice(['early', 1, 2, 3]) for i in dropped}
    before = httpx.get(srv.url + '/metrics').text

    async def main():
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.url, headers=headers, limits=limits,
                                     timeout=httpx.Timeout(TIMEOUT_S, connect=30)) as client:

            async def one(i):
                prompt = PROMPTS[i % len(PROMPTS)]
                plan = plans.get(i)
                if plan == 'early':
                    try:
                        await asyncio.wait_for(_stream(client, prompt), timeout=rng.uniform(0.05, 1.5))
                    except asyncio.TimeoutError:
                        pass
                    return i, None
                return i, await _stream(client, prompt, drop_after_chunks=plan)

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(NUM_REQUESTS))), TIMEOUT_S)

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    completed = 0
    for i, res in results:
        if i in dropped:
            continue
        text, usage, done, reasons = res
        prompt = PROMPTS[i % len(PROMPTS)]
        assert done, (i, res)
        assert text == expected[prompt], (i, text, expected[prompt])
        assert reasons == ['length']
        assert usage == {'prompt_tokens': len(tok.encode(prompt)), 'completion_tokens': MAX_TOKENS,
                         'total_tokens': len(tok.encode(prompt)) + MAX_TOKENS}
        completed += 1
    assert completed == NUM_REQUESTS - len(dropped)
    print(f'\nload: {NUM_REQUESTS} streams ({len(dropped)} dropped) in {elapsed:.1f}s')
    # nothing left behind: no running request, no leaked KV block, /metrics agrees
    assert_clean(srv, timeout=60)
    after = httpx.get(srv.url + '/metrics').text
    assert metric(after, 'lmdeploy_num_requests_running') == 0
    assert metric(after, 'lmdeploy_num_requests_waiting') == 0
    assert metric(after, 'lmdeploy_kv_cache_blocks_used') == 0

    def finished(text, reason):
        try:
            return metric(text, f'lmdeploy_requests_total{{endpoint="completions",finish_reason="{reason}"}}')
        except KeyError:
            return 0.0

    assert finished(after, 'length') - finished(before, 'length') >= completed
    # disconnects really cancelled work: the engine made fewer tokens than 200 full requests
    assert finished(after, 'abort') - finished(before, 'abort') > 0
    generated = (metric(after, 'lmdeploy_engine_generated_tokens_total') -
                 metric(before, 'lmdeploy_engine_generated_tokens_total'))
    assert generated < NUM_REQUESTS * MAX_TOKENS
    # and the server still serves
    with httpx.Client(base_url=srv.url, headers=headers, timeout=60) as c:
        r = c.post('/v1/completions', json={**_body(PROMPTS[0]), 'stream': False, 'stream_options': None})
        assert r.json()['choices'][0]['text'] == expected[PROMPTS[0]]
