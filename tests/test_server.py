"""The API server, started for real on 127.0.0.1 (uvicorn on a background
thread, the embedded SmolLM2-135M on cpu) and driven with the unmodified
``openai`` package, raw HTTP and ``lmdeploy.serve.client.APIClient``."""
from __future__ import annotations

import importlib.util
import json
import socket
import time
from types import SimpleNamespace

import pytest

openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')
pytest.importorskip('fastapi')
pytest.importorskip('uvicorn')
pytest.importorskip('prometheus_client')

MODEL = 'smollm2'
KEY = 'sk-test-key'
SESSION_LEN = 1024
MAX_BODY = 1 << 20


def start_server(model_path: str, session_len: int = SESSION_LEN, **app_kwargs) -> SimpleNamespace:
    from lmdeploy.frontend.gateway import Gateway
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.serve.openai.api_server import BackgroundServer, create_app
    # 256 blocks of 64 tokens: room for every test (the load test runs 64 sequences at a time)
    config = PytorchEngineConfig(device_type='cpu', session_len=session_len, num_gpu_blocks=256)
    gateway = Gateway(model_path, config, model_name=MODEL)
    app = create_app(gateway, **{'api_keys': [KEY], 'max_body_bytes': MAX_BODY, 'max_log_len': 64, **app_kwargs})
    server = BackgroundServer(app).start()
    return SimpleNamespace(url=server.url, gateway=gateway, engine=gateway.engine, app=app,
                           state=app.state.lmdeploy, server=server)


def stop_server(srv: SimpleNamespace):
    srv.server.stop()
    srv.gateway.close()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + ' ') or line.startswith(name + '{'):
            return float(line.rsplit(' ', 1)[1])
    raise KeyError(name)


def assert_clean(srv, timeout: float = 30.0):
    """Nothing running, no KV block leaked, and /metrics agrees."""
    assert srv.engine.wait_idle(timeout)
    srv.engine.check_invariants()
    stats = srv.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks, stats
    text = httpx.get(srv.url + '/metrics').text
    assert metric(text, 'lmdeploy_num_requests_running') == 0
    assert metric(text, 'lmdeploy_kv_cache_blocks_free') == metric(text, 'lmdeploy_kv_cache_blocks_total')
    deadline = time.monotonic() + 5
    while metric(text, 'lmdeploy_api_requests_in_flight') != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        text = httpx.get(srv.url + '/metrics').text
    assert metric(text, 'lmdeploy_api_requests_in_flight') == 0


@pytest.fixture(scope='module')
def srv(smollm2_path):
    s = start_server(smollm2_path)
    yield s
    stop_server(s)


@pytest.fixture(scope='module')
def client(srv):
    return openai.OpenAI(base_url=srv.url + '/v1', api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope='module')
def http(srv):
    with httpx.Client(base_url=srv.url, headers={'Authorization': f'Bearer {KEY}'}, timeout=120) as c:
        yield c


MESSAGES = [{'role': 'user', 'content': 'What is the capital of France?'}]


# ------------------------------------------------------------------- openai
def test_models_list(client, srv):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == 'model'


def test_chat_non_stream_usage(client, srv):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                       logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert r.object == 'chat.completion' and choice.message.role == 'assistant'
    assert 'Paris' in choice.message.content
    assert choice.finish_reason in ('stop', 'length')
    # usage: the tokens sent (the rendered chat prompt) and received
    assert r.usage.prompt_tokens == len(srv.gateway.encode_prompt(MESSAGES))
    assert r.usage.completion_tokens == len(choice.logprobs.content) > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert ''.join(t.token for t in choice.logprobs.content).strip() == choice.message.content.strip()
    for t in choice.logprobs.content:
        assert t.logprob <= 0 and 1 <= len(t.top_logprobs) <= 2
        assert t.top_logprobs[0].logprob >= t.logprob - 1e-6  # greedy: the chosen one is the best


def test_chat_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=24, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={'include_usage': True}, **kwargs))
    text = ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_raw_sse_ends_with_done(http):
    with http.stream('POST', '/v1/chat/completions', json=dict(model=MODEL, messages='Hi', max_tokens=4,
                                                                 stream=True)) as r:
        assert r.status_code == 200 and r.headers['content-type'].startswith('text/event-stream')
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == 'data: [DONE]'
    first = json.loads(events[0][len('data: '):])
    assert first['object'] == 'chat.completion.chunk' and first['choices'][0]['delta']['role'] == 'assistant'
    assert 'usage' not in first  # only with stream_options.include_usage


def test_chat_content_parts_equal_text(client):
    parts = [{'role': 'user', 'content': [{'type': 'text', 'text': 'What is the capital'},
                                          {'type': 'text', 'text': 'of France?'}]}]
    text = [{'role': 'user', 'content': 'What is the capital\nof France?'}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=text, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_seed_reproducible(client):
    kwargs = dict(model=MODEL, messages=[{'role': 'user', 'content': 'Write a short poem.'}], max_tokens=16,
                  temperature=1.0, seed=1234, extra_body={'top_k': 0})
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b and a


def test_completions(client, srv):
    prompt = '1, 2, 3, 4, 5,'
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={'ignore_eos': True})
    assert r.object == 'text_completion'
    assert r.choices[0].text.startswith(' 6, 7')
    assert r.choices[0].finish_reason == 'length'
    assert r.usage.prompt_tokens == len(srv.gateway.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 6
    # stream: same text, usage at the end
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                            stream_options={'include_usage': True}, extra_body={'ignore_eos': True}))
    assert ''.join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_completions_list_of_prompts_and_logprobs(client, srv):
    prompts = ['1, 2, 3, 4,', 'a, b, c, d,']
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    by_index = {c.index: c for c in r.choices}
    assert by_index[0].text.startswith(' 5')
    assert by_index[1].text.startswith(' e')
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
        assert ''.join(c.logprobs.tokens) == c.text
    tok = srv.gateway.tokenizer
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    # token-id prompts
    ids = tok.encode(prompts[0])
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert r2.choices[0].text == by_index[0].text


def test_stop_words(client):
    base = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    text = base.choices[0].message.content
    assert ' is ' in text
    stopped = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                             stop=[' is '])
    assert stopped.choices[0].message.content == text[:text.index(' is ')]
    assert stopped.choices[0].finish_reason == 'stop'
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stop=' is ', stream=True))
    assert ''.join(c.choices[0].delta.content or '' for c in chunks) == text[:text.index(' is ')]
    comp = client.completions.create(model=MODEL, prompt='1, 2, 3, 4, 5,', max_tokens=12, temperature=0,
                                     stop=['8'])
    assert comp.choices[0].text == ' 6, 7, ' and comp.choices[0].finish_reason == 'stop'


def test_wrong_and_missing_key_401(srv, client):
    bad = openai.OpenAI(base_url=srv.url + '/v1', api_key='sk-wrong', max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401
    assert set(e.value.body) >= {'message', 'type', 'code'}  # openai unwraps {"error": ...}
    r = httpx.post(srv.url + '/v1/chat/completions', json=dict(model=MODEL, messages='hi'))
    assert r.status_code == 401 and set(r.json()['error']) >= {'message', 'type', 'code'}
    r = httpx.get(srv.url + '/v1/models', headers={'Authorization': 'Basic abc'})
    assert r.status_code == 401
    assert client.models.list().data  # still serving


# -------------------------------------------------------------------- errors
LONG_PROMPT = 'hello ' * (SESSION_LEN + 10)
CHAT = '/v1/chat/completions'
COMP = '/v1/completions'
ERROR_CASES = [
    # (path, body, status, code)
    (CHAT, dict(model='gpt-4', messages='hi'), 404, 'model_not_found'),
    (COMP, dict(model='nope', prompt='hi'), 404, 'model_not_found'),
    (CHAT, dict(model=MODEL, messages='hi', n=17), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', n=0), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', n=2, session_id=5), 400, 'invalid_value'),
    (COMP, dict(model=MODEL, prompt=['hi'] * 200, n=2), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', temperature=-1), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', top_p=0), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', max_tokens=0), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', max_tokens=SESSION_LEN), 400, 'context_length_exceeded'),
    (CHAT, dict(model=MODEL, messages=LONG_PROMPT), 400, 'context_length_exceeded'),
    (COMP, dict(model=MODEL, prompt=LONG_PROMPT, max_tokens=4), 400, 'context_length_exceeded'),
    (COMP, dict(model=MODEL, prompt='hi', max_tokens=SESSION_LEN), 400, 'context_length_exceeded'),
    (CHAT, dict(model=MODEL, messages='hi', presence_penalty=2.5), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', frequency_penalty=-2.5), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', logit_bias={'1': 150}), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', top_logprobs=2), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', logprobs=True, top_logprobs=50), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', stop=['']), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages=[]), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages=[{'role': 'wizard', 'content': 'hi'}]), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages=[{'role': 'user', 'content': [
        {'type': 'image_url', 'image_url': {'url': 'http://x/y.png'}}]}]), 400, 'invalid_value'),
    # tools: unknown function in tool_choice, bad names, duplicates, bad parameter schemas, choice without tools
    (CHAT, dict(model=MODEL, messages='hi', tools=[{'type': 'function', 'function': {'name': 'f'}}],
                tool_choice={'type': 'function', 'function': {'name': 'g'}}), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', tools=[{'type': 'function', 'function': {'name': 'f g'}}]), 400,
     'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', tools=[{'type': 'function', 'function': {'name': 'f'}}] * 2), 400,
     'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', tool_choice='required'), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', tools=[{'type': 'function', 'function': {'name': 'f'}}],
                tool_choice='always'), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', tools=[{'type': 'function', 'function': {
        'name': 'f', 'parameters': {'type': 'object', 'properties': {'a': {'type': 'nonsense'}}}}}],
        tool_choice='required'), 400, 'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', tools=[{'type': 'function', 'function': {'name': 'f'}}],
                functions=[{'name': 'f'}]), 400, 'invalid_value'),  # the deprecated form beside tools
    (CHAT, dict(model=MODEL, messages=[{'role': 'assistant', 'tool_calls': [{'id': 'x', 'function': 'f'}]}]), 400,
     'invalid_body'),
    (CHAT, dict(model=MODEL, messages='hi', response_format={'type': 'json_schema', 'json_schema': {
        'name': 'x', 'schema': {'type': 'object', 'properties': {'a': {'type': 'nonsense'}}}}}), 400,
     'invalid_value'),
    (CHAT, dict(model=MODEL, messages='hi', response_format={'type': 'regex', 'regex': '[a-'}), 400, 'invalid_value'),
    (COMP, dict(model=MODEL, prompt='hi', response_format={'type': 'yaml'}), 400, 'invalid_value'),
    (COMP, dict(model=MODEL, prompt=[]), 400, 'invalid_value'),
    (COMP, dict(model=MODEL, prompt=''), 400, 'invalid_value'),
    (COMP, dict(model=MODEL, prompt=[1, 2, 10 ** 9]), 400, 'invalid_value'),
    (COMP, dict(model=MODEL, prompt='hi', suffix='there'), 400, 'unsupported_parameter'),
    (COMP, dict(model=MODEL, prompt='hi', best_of=2), 400, 'unsupported_parameter'),
    (COMP, dict(model=MODEL, prompt='hi', logprobs=100), 400, 'invalid_value'),
    ('/generate', dict(prompt=LONG_PROMPT), 400, 'context_length_exceeded'),
    ('/generate', dict(prompt='hi', top_k=-1), 400, 'invalid_value'),
    # malformed bodies: 400, as OpenAI answers them
    (CHAT, dict(model=MODEL), 400, 'invalid_body'),
    (CHAT, dict(messages='hi'), 400, 'invalid_body'),
    (CHAT, dict(model=MODEL, messages=12), 400, 'invalid_body'),
    (CHAT, dict(model=MODEL, messages='hi', max_tokens='many'), 400, 'invalid_body'),
    (COMP, dict(model=MODEL, prompt={'a': 1}), 400, 'invalid_body'),
    (COMP, dict(model=MODEL, prompt=[True, 2]), 400, 'invalid_body'),
    (COMP, [1, 2, 3], 400, 'invalid_body'),
    ('/generate', dict(input_ids=[False]), 400, 'invalid_body'),
    ('/generate', dict(input_ids=['7']), 400, 'invalid_body'),
    ('/generate', dict(prompt='hi', max_tokens=4, request_output_len=5), 400, 'invalid_value'),
]


@pytest.mark.parametrize('path,body,status,code', ERROR_CASES,
                         ids=[f'{i}-{c[0].strip("/").replace("/", "_")}-{c[2]}' for i, c in enumerate(ERROR_CASES)])
def test_error_cases(http, path, body, status, code):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()['error']
    assert set(err) >= {'message', 'type', 'code'} and err['message']
    if code is not None:
        assert err['code'] == code, err


def test_error_cases_raw(http, srv):
    # not JSON at all
    r = http.post(CHAT, content=b'{"model": ', headers={'Content-Type': 'application/json'})
    err = r.json()['error']
    assert r.status_code == 400 and err['code'] == 'invalid_body' and err['param'] is None
    assert 'not valid JSON' in err['message'], err
    # a missing field is named, in words and in param
    err = http.post(CHAT, json=dict(messages='hi')).json()['error']
    assert err['param'] == 'model' and "missing required parameter: 'model'" in err['message'], err
    # unknown route, wrong method
    r = http.get('/v1/nothing-here')
    assert r.status_code == 404 and r.json()['error']['code'] == 'not_found'
    r = http.get(CHAT)
    assert r.status_code == 405 and 'error' in r.json()
    # body over the limit
    r = http.post(CHAT, json=dict(model=MODEL, messages='x' * (MAX_BODY + 1)))
    assert r.status_code == 413 and r.json()['error']['code'] == 'request_too_large'


def test_generate_takes_max_tokens_as_request_output_len(http):
    a = http.post('/generate', json=dict(prompt='Count: 1, 2, 3,', max_tokens=3, ignore_eos=True, temperature=0))
    b = http.post('/generate', json=dict(prompt='Count: 1, 2, 3,', request_output_len=3, ignore_eos=True,
                                         temperature=0))
    assert a.status_code == b.status_code == 200, a.text
    assert a.json()['tokens'] == 3 and a.json()['text'] == b.json()['text']


def test_server_keeps_serving_after_errors(client, srv):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.choices[0].message.content
    assert_clean(srv)


def test_openai_client_error_classes(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model='unknown-model', messages=MESSAGES)
    assert e.value.code == 'model_not_found'
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=99)


def test_not_ready_and_draining_503(srv):
    from fastapi.testclient import TestClient

    from lmdeploy.serve.openai.api_server import create_app
    app = create_app(None, model_name=MODEL)
    with TestClient(app) as c:
        for path in ('/health', '/v1/models'):
            r = c.get(path)
            assert r.status_code == 503 and r.json()['error']['code'] == 'engine_not_ready'
        r = c.post(CHAT, json=dict(model=MODEL, messages='hi'))
        assert r.status_code == 503
        app.state.lmdeploy.set_gateway(srv.gateway)
        assert c.get('/health').status_code == 200
        assert c.get('/v1/models').json()['data'][0]['id'] == MODEL
        app.state.lmdeploy.draining = True
        r = c.post(CHAT, json=dict(model=MODEL, messages='hi'))
        assert r.status_code == 503 and r.json()['error']['code'] == 'shutting_down'
        assert c.get('/health').status_code == 503


def test_health_and_metrics(srv, http):
    assert httpx.get(srv.url + '/health').json() == {'status': 'ok'}
    http.post(CHAT, json=dict(model=MODEL, messages='Hi', max_tokens=4))
    with http.stream('POST', CHAT, json=dict(model=MODEL, messages='Hi', max_tokens=4, ignore_eos=True,
                                             stream=True)) as r:
        r.read()
    text = httpx.get(srv.url + '/metrics').text  # no key needed
    for name in ('lmdeploy_num_requests_running', 'lmdeploy_num_requests_waiting', 'lmdeploy_kv_cache_blocks_used',
                 'lmdeploy_kv_cache_blocks_free', 'lmdeploy_engine_generated_tokens_total',
                 'lmdeploy_time_to_first_token_seconds_count', 'lmdeploy_time_per_output_token_seconds_count',
                 'lmdeploy_e2e_request_latency_seconds_count'):
        metric(text, name)
    assert metric(text, 'lmdeploy_time_to_first_token_seconds_count') > 0
    assert metric(text, 'lmdeploy_time_per_output_token_seconds_count') > 0
    assert metric(text, 'lmdeploy_engine_generated_tokens_total') > 0
    assert 'lmdeploy_requests_total{endpoint="chat"' in text
    assert 'lmdeploy_http_errors_total{status="400"}' in text


# --------------------------------------------------------------- disconnect
def test_client_disconnect_cancels_and_frees_blocks(srv, http):
    engine = srv.engine
    body = dict(model=MODEL, messages='Tell me a very long story.', max_tokens=800, stream=True, ignore_eos=True)
    with http.stream('POST', CHAT, json=body) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith('data: {'):
                got += 1
            if got >= 3:
                break
        assert engine.stats().num_running == 1
        at_close = engine.stats().num_generated_tokens
    # the connection is closed: the request is cancelled at the next engine step
    deadline = time.monotonic() + 10
    while engine.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.005)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
    assert stats.num_generated_tokens - at_close <= 5  # a step or so, not the 800 asked for
    assert_clean(srv)


def gone_responses(srv) -> float:
    text = httpx.get(srv.url + '/metrics').text
    return sum(float(line.rsplit(' ', 1)[1]) for line in text.splitlines()
               if line.startswith('lmdeploy_http_errors_total{') and 'status="499"' in line)


def test_disconnect_while_not_streaming(srv):
    """A non-streaming request whose client goes away is cancelled too, and
    counted as a 499 (client closed request)."""
    engine = srv.engine
    gone_before = gone_responses(srv)
    body = json.dumps(dict(model=MODEL, messages='Tell me a very long story.', max_tokens=800, ignore_eos=True))
    host, port = srv.url.rsplit('//', 1)[1].split(':')
    with socket.create_connection((host, int(port))) as s:
        s.sendall((f'POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n'
                   f'Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}').encode())
        deadline = time.monotonic() + 10
        while engine.stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.stats().num_running == 1
    deadline = time.monotonic() + 10
    while engine.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats().num_running == 0
    while gone_responses(srv) == gone_before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gone_responses(srv) == gone_before + 1
    assert_clean(srv)


def test_slow_reader_does_not_block_others(srv, client):
    """A client that stops reading its stream does not hold up anyone else."""
    host, port = srv.url.rsplit('//', 1)[1].split(':')
    body = json.dumps(dict(model=MODEL, messages='Tell me a long story.', max_tokens=300, ignore_eos=True,
                           stream=True))
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        s.sendall((f'POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n'
                   f'Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}').encode())
        time.sleep(0.5)
        t0 = time.monotonic()
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
        assert r.choices[0].message.content and time.monotonic() - t0 < 30
    finally:
        s.close()
    assert_clean(srv)


# ----------------------------------------------------------------- /generate
def test_generate_interactive_session(srv):
    from lmdeploy.serve.client import APIClient
    with APIClient(srv.url, api_key=KEY) as api:
        assert api.health() and api.available_models == [MODEL]
        first = next(api.generate('My name is Bob.', session_id=42, interactive_mode=True, request_output_len=16,
                                  temperature=0))
        assert first['session_id'] == 42 and first['history_tokens'] == 0 and first['tokens'] > 0
        assert srv.engine.wait_idle(10) and srv.engine.stats().num_idle_sessions == 1
        items = list(api.generate('What is my name?', session_id=42, interactive_mode=True, stream=True,
                                  request_output_len=16, temperature=0))
        second = items[-1]
        assert second['finish_reason'] in ('stop', 'length')
        # the second turn's context holds the first turn (prompt + reply)
        assert second['history_tokens'] >= first['input_tokens'] + first['tokens']
        assert ''.join(i['text'] for i in items)
        # a concurrent request on a busy session is refused; a chat request can't take it over
        r = httpx.post(srv.url + CHAT, json=dict(model=MODEL, messages='hi', session_id=42),
                       headers={'Authorization': f'Bearer {KEY}'})
        assert r.status_code == 400 and r.json()['error']['code'] == 'session_busy'
        api.end_session(42)
        assert srv.engine.wait_idle(10) and srv.engine.stats().num_idle_sessions == 0
        # after the end, the same id starts afresh
        again = next(api.generate('My name is Bob.', session_id=42, interactive_mode=False, request_output_len=16,
                                  temperature=0))
        assert again['history_tokens'] == 0 and again['text'] == first['text']
    assert_clean(srv)


def test_generate_stream_equals_non_stream(srv):
    from lmdeploy.serve.client import APIClient
    with APIClient(srv.url, api_key=KEY) as api:
        full = next(api.generate('Name three colors.', request_output_len=20, temperature=0))
        parts = list(api.generate('Name three colors.', request_output_len=20, temperature=0, stream=True))
        assert ''.join(p['text'] for p in parts) == full['text']
        assert parts[-1]['tokens'] == full['tokens'] and parts[-1]['finish_reason'] == full['finish_reason']
        assert sum(len(p['token_ids']) for p in parts) == len(full['token_ids'])


def test_generate_cancel(srv):
    import threading

    from lmdeploy.serve.client import APIClient
    api = APIClient(srv.url, api_key=KEY)
    result = {}

    def run():
        result['r'] = next(api.generate('Tell me a long story.', session_id=77, request_output_len=800,
                                        ignore_eos=True))

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    while srv.engine.stats().num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    with APIClient(srv.url, api_key=KEY) as other:
        other.cancel(77)
    t.join(30)
    api.close()
    assert result['r']['finish_reason'] == 'abort' and result['r']['tokens'] < 800
    assert_clean(srv)


# ----------------------------------------------------------------- APIClient
def test_api_client_openai_endpoints(srv):
    from lmdeploy.serve.client import APIClient, APIClientError
    api = APIClient(srv.url + '/v1', api_key=KEY)
    out = list(api.chat_completions_v1(MODEL, MESSAGES, max_tokens=8, temperature=0))
    assert len(out) == 1 and out[0]['choices'][0]['message']['content']
    chunks = list(api.chat_completions_v1(MODEL, MESSAGES, max_tokens=8, temperature=0, stream=True))
    assert ''.join(c['choices'][0]['delta'].get('content') or '' for c in chunks) == \
        out[0]['choices'][0]['message']['content']
    comp = list(api.completions_v1(MODEL, '1, 2, 3,', max_tokens=4, temperature=0, stream=True))
    assert ''.join(c['choices'][0]['text'] for c in comp).startswith(' 4')
    with pytest.raises(APIClientError) as e:
        list(api.chat_completions_v1('other', MESSAGES))
    assert e.value.status == 404 and e.value.code == 'model_not_found'
    with APIClient(srv.url, api_key='wrong') as wrong:
        assert wrong.health()  # /health needs no key
        with pytest.raises(APIClientError) as e:
            wrong.available_models
        assert e.value.status == 401
    assert 'lmdeploy_kv_cache_blocks_total' in api.metrics()
    api.close()


def test_import_lmdeploy_stays_server_free():
    import subprocess
    import sys
    code = ('import sys, lmdeploy, lmdeploy.engine, lmdeploy.serve.client; '
            'bad = [m for m in ("fastapi", "uvicorn", "pydantic", "prometheus_client", "starlette") '
            'if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)')
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120,
                       cwd=__import__('os').path.dirname(__import__('os').path.dirname(__file__)))
    assert r.returncode == 0, r.stdout + r.stderr


def test_json_body_without_content_type(srv):
    """``curl -d '{...}'`` (a form content type) still reads as JSON."""
    r = httpx.post(srv.url + '/generate', content=json.dumps(dict(prompt='hi', request_output_len=2)),
                   headers={'Authorization': f'Bearer {KEY}', 'Content-Type': 'application/x-www-form-urlencoded'})
    assert r.status_code == 200 and r.json()['tokens'] >= 1


def test_stalled_reader_asgi_level(srv):
    """In one event loop: a response whose send() never returns (a reader that
    stopped reading) does not hold up another request; when that client goes
    away its request is cancelled."""
    import asyncio

    from lmdeploy.serve.openai.api_server import create_app
    app = create_app(srv.gateway, model_name=MODEL)

    async def call(body: dict, stall_after: int = None):
        data = json.dumps(body).encode()
        scope = {'type': 'http', 'asgi': {'version': '3.0', 'spec_version': '2.3'}, 'http_version': '1.1',
                 'method': 'POST', 'scheme': 'http', 'path': CHAT, 'raw_path': CHAT.encode(), 'query_string': b'',
                 'root_path': '', 'client': ('127.0.0.1', 1), 'server': ('127.0.0.1', 80),
                 'headers': [(b'content-type', b'application/json'), (b'content-length', str(len(data)).encode())]}
        state = {'body_sent': False, 'chunks': [], 'stalled': asyncio.Event(), 'gone': asyncio.Event()}

        async def receive():
            if not state['body_sent']:
                state['body_sent'] = True
                return {'type': 'http.request', 'body': data, 'more_body': False}
            await state['gone'].wait()
            return {'type': 'http.disconnect'}

        async def send(message):
            if message['type'] == 'http.response.body' and message.get('body'):
                if stall_after is not None and len(state['chunks']) >= stall_after:
                    state['stalled'].set()
                    await asyncio.Event().wait()  # never returns: the reader stopped
                state['chunks'].append(message['body'])

        task = asyncio.ensure_future(app(scope, receive, send))
        return task, state

    async def main():
        slow, slow_state = await call(dict(model=MODEL, messages='Tell me a long story.', max_tokens=400,
                                           ignore_eos=True, stream=True), stall_after=2)
        await asyncio.wait_for(slow_state['stalled'].wait(), 60)
        fast, fast_state = await call(dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0))
        await asyncio.wait_for(fast, 60)  # served while the other one is stuck in send()
        reply = json.loads(b''.join(fast_state['chunks']))
        assert reply['choices'][0]['message']['content']
        assert not slow.done() and srv.engine.stats().num_running == 1
        slow_state['gone'].set()  # the stalled client disconnects: its request is cancelled
        await asyncio.wait_for(slow, 30)
        deadline = time.monotonic() + 10
        while srv.engine.stats().num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert srv.engine.stats().num_running == 0

    asyncio.run(main())
    assert_clean(srv)


EXTREMES = [
    dict(top_k=10 ** 12, temperature=1.0),
    dict(seed=2 ** 80, temperature=1.0),
    dict(seed=-5, temperature=1.0),
    dict(repetition_penalty=100.0),
    dict(repetition_penalty=1e-9),
    dict(temperature=1e-300),
    dict(temperature=2.0, top_p=1e-300),
    dict(min_p=1.0, temperature=1.0),
    dict(min_new_tokens=10 ** 9),
    dict(stop=['a' * 256] * 16),
    dict(top_k=0, temperature=2.0, top_p=1.0, min_p=0.0),
]


@pytest.mark.parametrize('extra', EXTREMES, ids=[str(i) for i in range(len(EXTREMES))])
def test_extreme_valid_values_do_not_break_the_engine(http, srv, extra):
    """Odd but valid settings: answered (200 or a clear 400), never a 5xx, and
    the engine keeps serving."""
    r = http.post(CHAT, json=dict(model=MODEL, messages='Hi', max_tokens=3, **extra))
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        assert r.json()['choices'][0]['finish_reason'] in ('stop', 'length')
    ok = http.post(CHAT, json=dict(model=MODEL, messages='Hi', max_tokens=2))
    assert ok.status_code == 200


# --------------------------------------------------------------------------- strict validation
STRICT_CASES = [
    # (path, body, code, param): what the schema does not allow is refused, with one error naming the field
    (CHAT, dict(model=MODEL, messages=''), 'invalid_value', 'messages'),
    (CHAT, dict(model=MODEL, messages='hi', max_tokens='8'), 'invalid_body', 'max_tokens'),
    (CHAT, dict(model=MODEL, messages='hi', max_tokens=True), 'invalid_body', 'max_tokens'),
    (CHAT, dict(model=MODEL, messages='hi', temperature=False), 'invalid_body', 'temperature'),
    (CHAT, dict(model=MODEL, messages='hi', n=2.5), 'invalid_body', 'n'),
    (CHAT, dict(model=MODEL, messages='hi', stream='true'), 'invalid_body', 'stream'),
    (CHAT, dict(model=MODEL, messages='hi', seed='7'), 'invalid_body', 'seed'),
    (CHAT, dict(model=MODEL, messages=[{'role': 'wizard', 'content': 'hi'}]), 'invalid_value', 'messages.0.role'),
    (CHAT, dict(model=MODEL, messages=[{'role': 'user', 'content': [{'type': 'text'}]}]), 'invalid_body',
     'messages.0.content.0.text'),
    (CHAT, dict(model=MODEL, messages=[{'role': 'user', 'content': [{'type': 'text', 'text': 5}]}]), 'invalid_body',
     'messages.0.content.0.text'),
    (CHAT, dict(model=MODEL, messages='hi', stop=['a'] * 17), 'invalid_value', 'stop'),
    (CHAT, dict(model=MODEL, messages='hi', stop='x' * 257), 'invalid_value', 'stop'),
    (CHAT, dict(model=MODEL, messages='hi', tool_choice={'type': 'function'}), 'invalid_body', 'tool_choice.function'),
    (CHAT, dict(model=MODEL, messages='hi', response_format={'type': 'json_schema'}), 'invalid_body',
     'response_format.json_schema'),
    (COMP, dict(model=MODEL, prompt=['a', 7]), 'invalid_body', 'prompt.1'),
    (COMP, dict(model=MODEL, prompt=[7, '8']), 'invalid_body', 'prompt.1'),
    (COMP, dict(model=MODEL, prompt=[7, -1]), 'invalid_value', 'prompt.1'),
    ('/generate', dict(input_ids=[1, 2.5]), 'invalid_body', 'input_ids.1'),
    ('/generate', dict(prompt='hi', top_k='40'), 'invalid_body', 'top_k'),
    ('/generate', dict(prompt='hi', max_tokens=2, request_output_len=2), 'invalid_value', 'max_tokens'),
]


@pytest.mark.parametrize('path,body,code,param', STRICT_CASES, ids=[str(i) for i in range(len(STRICT_CASES))])
def test_strict_validation_one_error(http, path, body, code, param):
    """Strings and booleans are not numbers, an empty messages string is not a conversation: refused as
    the schema says, with the one error that applies (a union is read by the value's JSON type, so an
    array of messages is not also reported as "not a string")."""
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()['error']
    assert (err['code'], err['param']) == (code, param), err
    assert ';' not in err['message'] and param.split('.')[0] in err['message'], err


def test_whole_numbers_are_integers(http):
    """JSON Schema's integers include 2.0: taken as 2 (a string or a boolean is not one)."""
    r = http.post(CHAT, json=dict(model=MODEL, messages='Hi', max_tokens=2.0, n=1.0, temperature=0, seed=3.0))
    assert r.status_code == 200 and r.json()['usage']['completion_tokens'] <= 2, r.text
    r = http.post(COMP, json=dict(model=MODEL, prompt=[504, 2.0, 314], max_tokens=2, ignore_eos=True))
    assert r.status_code == 200 and r.json()['usage'] == {'prompt_tokens': 3, 'completion_tokens': 2,
                                                          'total_tokens': 5}, r.text


def test_unreadable_bodies_have_a_code(http):
    """Bodies the JSON reader gives up on (not UTF-8, a number of 5,000 digits, 100,000 nested arrays) and
    strings that are not Unicode text are each a 400 with a code and a reason, not ``code: null``."""
    raw = {
        b'{"model": "smollm2", "messages": "\xff\xfe"}': ('not valid UTF-8', None),
        b'{"model": "smollm2", "messages": "hi", "seed": ' + b'9' * 5000 + b'}': ('too many digits', None),
        b'[' * 100000 + b']' * 100000: ('nests', None),
    }
    for body, (words, param) in raw.items():
        r = http.post(CHAT, content=body, headers={'Content-Type': 'application/json'})
        err = r.json()['error']
        assert r.status_code == 400 and err['code'] == 'invalid_body' and words in err['message'], err
    r = http.post(CHAT, content=b'{"model": "smollm2", "messages": "hi", "stop": ["\\ud800"]}',
                  headers={'Content-Type': 'application/json'})
    err = r.json()['error']  # a lone surrogate has no UTF-8 form: not a string the server can take
    assert r.status_code == 400 and (err['code'], err['param']) == ('invalid_body', 'stop.0'), err
    assert 'unicode' in err['message']


def test_the_served_schema_says_what_is_taken(srv):
    """The OpenAPI schema names the served model and the vocabulary's bound for token ids, and every limit
    as JSON Schema spells it (minimum / maximum, not pydantic's ge / le)."""
    schema = srv.app.openapi()
    text = json.dumps(schema)
    assert '"ge":' not in text and '"le":' not in text and '"gt":' not in text
    comps = schema['components']['schemas']
    vocab = srv.engine.model_config.vocab_size
    for name in ('ChatCompletionRequest', 'CompletionRequest'):
        assert comps[name]['properties']['model']['enum'] == [MODEL]
        assert any('if' in rule for rule in comps[name]['allOf'])
    ids = [arm for arm in comps['CompletionRequest']['properties']['prompt']['oneOf'] if 'items' in arm]
    assert any(arm['items'].get('maximum') == vocab - 1 for arm in ids)
    assert comps['GenerateRequest']['properties']['input_ids']['anyOf'][0]['items']['maximum'] == vocab - 1
    assert '500' in schema['paths']['/v1/chat/completions']['post']['responses']


# --------------------------------------------------------------------------- sampling defaults and faults
@pytest.mark.parametrize('temperature', [1e-300, 1e-46, 5e-324])
def test_temperature_that_is_zero_in_float32_is_greedy(http, temperature):
    """A temperature float32 holds as 0 decodes greedily (it used to give NaN logits: an empty reply, or
    with a grammar a 400 that blamed the request)."""
    def ask(**kw):
        r = http.post(CHAT, json=dict(model=MODEL, messages=MESSAGES, max_tokens=8, **kw))
        assert r.status_code == 200, r.text
        return r.json()['choices'][0]['message']['content']

    assert ask(temperature=temperature) == ask(temperature=0) and 'Paris' in ask(temperature=0)
    if importlib.util.find_spec('xgrammar'):
        fmt = {'type': 'json_object'}
        assert ask(temperature=temperature, response_format=fmt) == ask(temperature=0, response_format=fmt)


def test_tiny_repetition_penalty_is_honoured(http):
    r = http.post(CHAT, json=dict(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                  repetition_penalty=1e-46))
    assert r.status_code == 200 and r.json()['choices'][0]['message']['content'], r.text


def test_engine_faults_are_5xx(http, srv, monkeypatch):
    """NaN logits are the engine's fault: a 500 (code internal_error) whether the request samples or has a
    grammar, never a 400 that blames the request; the server keeps serving and frees every block."""
    import lmdeploy.engine.engine as engine_mod
    sample, mark = engine_mod.sample_tokens, 4242

    def nan_for_marked(logits, seqs, ops, grammars=None):
        rows = [i for i, s in enumerate(seqs) if s.params.seed == mark]
        if rows:
            logits = logits.clone()
            logits[rows] = float('nan')
        return sample(logits, seqs, ops, grammars)

    monkeypatch.setattr(engine_mod, 'sample_tokens', nan_for_marked)
    bodies = [dict(temperature=1.0)]
    if importlib.util.find_spec('xgrammar'):
        bodies.append(dict(temperature=0, response_format={'type': 'json_object'}))
    for extra in bodies:
        r = http.post(CHAT, json=dict(model=MODEL, messages='Hi', max_tokens=4, seed=mark, **extra))
        err = r.json()['error']
        assert r.status_code == 500 and err['code'] == 'internal_error' and 'engine fault' in err['message'], r.text
        with http.stream('POST', CHAT, json=dict(model=MODEL, messages='Hi', max_tokens=4, seed=mark, stream=True,
                                                 **extra)) as s:
            assert s.status_code == 500
    monkeypatch.undo()
    assert http.post(CHAT, json=dict(model=MODEL, messages='Hi', max_tokens=2, seed=mark,
                                     temperature=1.0)).status_code == 200
    assert_clean(srv)


def test_completions_max_tokens_defaults_to_16(http):
    """OpenAI's default for /v1/completions, whether max_tokens is left out or null."""
    for body in (dict(), dict(max_tokens=None)):
        r = http.post(COMP, json=dict(model=MODEL, prompt='Once upon a time', ignore_eos=True, **body))
        assert r.status_code == 200 and r.json()['usage']['completion_tokens'] == 16, r.text


def test_silent_requests_take_the_models_sampling_defaults(http, srv, monkeypatch):
    """Where a request names no temperature (or top_p, top_k, min_p, repetition_penalty), the model's
    generation_config.json decides: the default model's names none, so it decodes greedily (the README's
    client example answers as the CLI does); a model that says to sample at 1.0 is sampled at 1.0."""
    from lmdeploy.frontend.sampling_defaults import SamplingDefaults
    prompt = dict(model=MODEL, messages=MESSAGES, max_tokens=12)
    silent = [http.post(CHAT, json=prompt).json()['choices'][0]['message']['content'] for _ in range(2)]
    greedy = http.post(CHAT, json=dict(prompt, temperature=0)).json()['choices'][0]['message']['content']
    assert silent == [greedy, greedy] and 'Paris' in greedy
    gen = http.post('/generate', json=dict(prompt='What is the capital of France?', request_output_len=12)).json()
    assert gen['text'] == greedy
    monkeypatch.setattr(srv.gateway, 'sampling_defaults', SamplingDefaults(temperature=1.0, top_k=0))
    for seed in (1, 2):
        silent = http.post(CHAT, json=dict(prompt, seed=seed)).json()['choices'][0]['message']['content']
        hot = http.post(CHAT, json=dict(prompt, seed=seed, temperature=1.0, top_k=0)).json()
        assert silent == hot['choices'][0]['message']['content']
    assert http.post(CHAT, json=dict(prompt, temperature=0)).json()['choices'][0]['message']['content'] == greedy


def test_without_xgrammar_the_error_names_what_needs_it(http, srv, monkeypatch):
    """A forced tool choice needs xgrammar as much as response_format does: the refusal says which."""
    def missing():
        raise ValueError('response_format (structured output) needs the xgrammar package')

    monkeypatch.setattr(srv.gateway, 'grammars', missing)
    tools = [{'type': 'function', 'function': {'name': 'f'}}]
    for choice, words in (('required', 'tool_choice "required"'),
                          ({'type': 'function', 'function': {'name': 'f'}}, 'tool_choice naming a function')):
        r = http.post(CHAT, json=dict(model=MODEL, messages='hi', tools=tools, tool_choice=choice))
        err = r.json()['error']
        assert r.status_code == 400 and err['param'] == 'tool_choice' and err['code'] == 'unsupported_parameter'
        assert err['message'].startswith(words) and 'response_format' not in err['message'], err
    r = http.post(CHAT, json=dict(model=MODEL, messages='hi', response_format={'type': 'json_object'}))
    err = r.json()['error']
    assert r.status_code == 400 and err['param'] == 'response_format', err
    assert err['message'].startswith('response_format (structured output) needs the xgrammar package'), err


def test_text_chunks_match_the_pydantic_chunks():
    """The streams' text-only chunks (built from one dump of the response
    model) are byte for byte what the pydantic models give."""
    from lmdeploy.serve.openai import protocol as P
    from lmdeploy.serve.openai.jobs import TextChunks, sse

    def chat(delta, finish_reason=None):
        return P.ChatCompletionStreamResponse(id='chatcmpl-1', created=7, model='m', choices=[
            P.ChatCompletionStreamChoice(delta=delta, finish_reason=finish_reason)])

    def completion(text, finish_reason=None, index=0):
        return P.CompletionResponse(id='cmpl-1', created=7, model='m', choices=[
            P.CompletionChoice(index=index, text=text, finish_reason=finish_reason)])

    for usage in (True, False):
        chat_chunk = TextChunks(chat(P.DeltaMessage(content='')), usage)
        completion_chunk = TextChunks(completion(''), usage)
        for text, reason, index in (('Hello', None, 0), (' wörld "quoted" \\ \n', 'stop', 2), ('', 'length', 1)):
            assert chat_chunk(text, reason) == sse(chat(P.DeltaMessage(content=text), reason), usage)
            assert completion_chunk(text, reason, index) == sse(completion(text, reason, index), usage)


# --------------------------------------------------------------------------- structured output
PERSON = {'type': 'object', 'properties': {
    'name': {'type': 'string', 'maxLength': 40},
    'age': {'type': 'integer', 'minimum': 0, 'maximum': 150},
    'tags': {'type': 'array', 'items': {'type': 'string', 'enum': ['friend', 'colleague']}, 'maxItems': 3},
    'address': {'type': 'object', 'properties': {'city': {'type': 'string', 'maxLength': 30}},
                'required': ['city']}},
    'required': ['name', 'age', 'tags', 'address']}


JSON_MODE_MAX_TOKENS = 96


@pytest.mark.parametrize('stream', [False, True])
def test_json_schema_and_json_mode_always_parse(client, srv, stream):
    """Unmodified openai client, temperature 1.0, 20 seeds: every JSON-schema answer parses and
    validates (nested object, array, enum, required fields), every JSON-mode answer is a JSON object.
    Streamed: 8 JSON-schema seeds (the grammar is the same; what streaming adds is the joining of deltas),
    and JSON mode, whose unbounded answers make the longest pass, only unstreamed."""
    jsonschema = pytest.importorskip('jsonschema')
    pytest.importorskip('xgrammar')
    schema_fmt = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': PERSON}}
    patient = client.with_options(timeout=600)  # a whole answer of the batch below, on a busy CPU

    def ask(fmt, seed, max_tokens=160):
        kwargs = dict(model=MODEL, messages=[{'role': 'user', 'content': 'Describe a person as JSON.'}],
                      max_tokens=max_tokens, temperature=1.0, seed=seed, response_format=fmt)
        if not stream:
            r = patient.chat.completions.create(**kwargs)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, reason = '', None
        for chunk in patient.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ''
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    # all 28 requests in flight together: the engine batches them (one pass as long as the longest answer,
    # not 28 answers one after another on a CPU); each answer is checked as it would be alone
    # JSON mode's budget (96 tokens) is above the longest JSON-schema answer (72 measured, of 160 allowed), so
    # the pass lasts little longer than the schema answers need. Six of the 8 seeds end by themselves within 60
    # tokens (measured: 1, 6, 7, 43, 45, 59); the other two sample a string that runs on (195 and 200+ tokens),
    # which a larger budget only lets run for another hundred steps of a batch of one or two.
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(28) as pool:
        schema_answers = [pool.submit(ask, schema_fmt, seed) for seed in range(8 if stream else 20)]
        mode_answers = [] if stream else [pool.submit(ask, {'type': 'json_object'}, seed, JSON_MODE_MAX_TOKENS)
                                          for seed in range(8)]
    for seed, answer in enumerate(schema_answers):
        text, reason = answer.result()
        assert reason == 'stop', (seed, text)
        jsonschema.validate(json.loads(text), PERSON)
    # JSON mode bounds nothing: a sampled string may run until max_tokens (finish_reason 'length', as
    # OpenAI's JSON mode warns); every answer that ends by itself is an object
    finished = 0
    for seed, answer in enumerate(mode_answers):
        text, reason = answer.result()
        if reason == 'stop':
            finished += 1
            assert isinstance(json.loads(text), dict), (seed, text)
        else:
            assert reason == 'length' and text.startswith('{'), (seed, text)
    if mode_answers:
        print(f'JSON mode: {finished} of 8 answers ended by themselves')
        assert finished >= 4
    assert_clean(srv)


def test_regex_and_a_mixed_batch(client, http, srv):
    """A regex constrains /v1/completions too; constrained and unconstrained requests in flight together
    each give what they give alone (greedy)."""
    pytest.importorskip('xgrammar')
    import re
    import threading
    fmt = {'type': 'regex', 'regex': r'[0-9]{3}-[0-9]{4}'}
    alone = [http.post(COMP, json=dict(model=MODEL, prompt='My phone number is', max_tokens=12, temperature=0,
                                       response_format=fmt)).json(),
             http.post(COMP, json=dict(model=MODEL, prompt='My phone number is', max_tokens=12,
                                       temperature=0)).json()]
    assert re.fullmatch(fmt['regex'], alone[0]['choices'][0]['text']), alone[0]
    together = [None, None]

    def run(i, body):
        together[i] = http.post(COMP, json=body).json()

    bodies = [dict(model=MODEL, prompt='My phone number is', max_tokens=12, temperature=0, response_format=f)
              for f in (fmt, None)]
    threads = [threading.Thread(target=run, args=(i, b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r['choices'][0]['text'] for r in together] == [r['choices'][0]['text'] for r in alone]
    assert_clean(srv)


# --------------------------------------------------------------------------- n > 1
def test_n_choices_chat_and_completions(client, srv):
    """n=3 returns 3 choices, each what a seeded single request with seed + i gives; streaming interleaves
    choices by index and reassembles to the same; usage counts the prompt once and every choice's tokens;
    completions order choices prompt by prompt."""
    kw = dict(model=MODEL, messages=[{'role': 'user', 'content': 'Write a word.'}], max_tokens=8, temperature=1.0)
    r = client.chat.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=11 + i, **kw) for i in range(3)]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in singles]
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    texts = ['', '', '']
    for chunk in client.chat.completions.create(n=3, seed=11, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ''
    assert texts == [c.message.content for c in r.choices]
    comp = client.completions.create(model=MODEL, prompt=['1, 2,', 'a, b,'], n=2, max_tokens=3, temperature=0)
    assert [c.index for c in comp.choices] == [0, 1, 2, 3]
    assert comp.choices[0].text == comp.choices[1].text and comp.choices[2].text == comp.choices[3].text
    one = client.completions.create(model=MODEL, prompt='1, 2,', max_tokens=3, temperature=0)
    assert comp.choices[0].text == one.choices[0].text
    assert_clean(srv)


@pytest.mark.parametrize('prefix_caching', [True, False])
def test_n_choices_share_the_prompts_prefill(smollm2_path, prefix_caching):
    """A prompt's later choices start once its first has a token and take its full prompt blocks (prefix
    caching on or off): n=4 prefills the prompt about once, not four times."""
    from lmdeploy.frontend.gateway import Gateway
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.serve.openai.api_server import BackgroundServer, create_app
    config = PytorchEngineConfig(device_type='cpu', session_len=SESSION_LEN, num_gpu_blocks=64, block_size=16,
                                 enable_prefix_caching=prefix_caching)
    gateway = Gateway(smollm2_path, config, model_name=MODEL)
    server = BackgroundServer(create_app(gateway)).start()
    try:
        local = openai.OpenAI(base_url=server.url + '/v1', api_key='x')
        prompt = 'Tell me about the history of the city of Paris, its rivers and its bridges. ' * 3
        before = gateway.engine.stats().num_prefix_hit_tokens
        r = local.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=4, temperature=1.0, seed=3)
        hit = gateway.engine.stats().num_prefix_hit_tokens - before
        assert len(r.choices) == 4
        full_blocks = (r.usage.prompt_tokens // 16) * 16
        assert hit >= 3 * (full_blocks - 16), (hit, r.usage.prompt_tokens)
        before = gateway.engine.stats().num_prefix_hit_tokens
        c = local.chat.completions.create(model=MODEL, messages=[{'role': 'user', 'content': prompt}], n=3,
                                          max_tokens=4, temperature=1.0, seed=3)
        assert len(c.choices) == 3 and gateway.engine.stats().num_prefix_hit_tokens - before >= 2 * (
            c.usage.prompt_tokens // 16 * 16 - 16)
    finally:
        server.stop()
        gateway.close()
