"""Tool calling through the API server (SmolLM2 on cpu, the unmodified ``openai`` client): forced calls
always parse into the declared function's arguments, streamed calls reassemble into the non-streamed
one, tool results go back into the conversation, and a mixed batch gives each request what it gets
alone."""
from __future__ import annotations

import json
import threading

import pytest

openai = pytest.importorskip('openai')
pytest.importorskip('xgrammar')
pytest.importorskip('fastapi')

from lmdeploy.frontend.tool_calls import FORMATS  # noqa: E402
from test_server import KEY, MODEL, assert_clean, start_server, stop_server  # noqa: E402

WEATHER = {'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'The current weather in a city',
    'parameters': {'type': 'object', 'properties': {
        'city': {'type': 'string', 'maxLength': 30},
        'unit': {'type': 'string', 'enum': ['celsius', 'fahrenheit']},
        'days': {'type': 'integer', 'minimum': 1, 'maximum': 7}},
        'required': ['city', 'unit']}}}
TIME = {'type': 'function', 'function': {'name': 'get_time', 'description': 'The time in a time zone',
                                         'parameters': {'type': 'object', 'properties': {
                                             'zone': {'type': 'string', 'maxLength': 20}}, 'required': ['zone']}}}
ASK = [{'role': 'user', 'content': 'What is the weather like in Paris today?'}]


@pytest.fixture(scope='module')
def srv(smollm2_path):
    s = start_server(smollm2_path)
    yield s
    stop_server(s)


@pytest.fixture(scope='module')
def client(srv):
    return openai.OpenAI(base_url=srv.url + '/v1', api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def tool_format(srv):
    """Serve with another tool-call format for one test (as --tool-call-parser would)."""
    saved = srv.state._tool_format

    def use(name):
        srv.state._tool_format = FORMATS[name]
    yield use
    srv.state._tool_format = saved


def _streamed(client, **kw):
    """Text, calls (id, name, arguments) and finish reason of a streamed reply, checking the deltas'
    shape: a call's first delta has id, type and name; the later ones only argument pieces."""
    text, calls, reason = '', {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ''
            reason = c.finish_reason or reason
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == 'function' and tc.function.name, tc
                    calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or '']
                else:
                    assert tc.id is None and tc.function.name is None, tc
                    calls[tc.index][2] += tc.function.arguments or ''
    return text, [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize('fmt', ['llama3', 'qwen', 'internlm2'])
def test_required_tool_calls_always_parse(client, srv, tool_format, fmt):
    """tool_choice "required", temperature 1.0, several seeds, streaming and not: every reply is calls of the
    declared functions whose arguments validate against their schemas; finish_reason "tool_calls". With
    parallel calls the grammar lets the model go on calling: a small model may call until max_tokens cuts
    its last call (finish_reason "length"); every call before that one still validates. (The parallel ones
    stop at 64 tokens: the batch's pass lasts as long as its longest reply.)"""
    jsonschema = pytest.importorskip('jsonschema')
    tool_format(fmt)
    schemas = {t['function']['name']: t['function']['parameters'] for t in (WEATHER, TIME)}

    def kwargs(seed):
        return dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice='required', temperature=1.0,
                    seed=seed, max_tokens=120 if seed < 4 else 64, parallel_tool_calls=seed >= 4)

    # the 12 requests in flight together, batched by the engine (a seeded reply does not depend on its
    # batch: test_mixed_batch_each_as_alone), instead of one after another; each checked as before
    from concurrent.futures import ThreadPoolExecutor
    patient = client.with_options(timeout=600)
    with ThreadPoolExecutor(12) as pool:
        replies = [pool.submit(patient.chat.completions.create, **kwargs(seed)) for seed in range(6)]
        streamed = [pool.submit(_streamed, patient, **kwargs(seed)) for seed in range(6)]
    for seed in range(6):
        parallel = seed >= 4
        r = replies[seed].result()
        msg, reason = r.choices[0].message, r.choices[0].finish_reason
        assert msg.tool_calls and not (msg.content or '').strip(), (seed, msg)
        complete = msg.tool_calls
        if parallel and reason == 'length':
            complete = complete[:-1]
        else:
            assert reason == 'tool_calls', (seed, msg)
        if not parallel:
            assert len(msg.tool_calls) == 1
        for call in complete:
            assert call.type == 'function' and call.id.startswith('call_')
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        text, calls, s_reason = streamed[seed].result()
        assert s_reason == reason and not text.strip()
        assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert_clean(srv)


def test_named_function_is_called(client, srv):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=seed, max_tokens=80,
            tool_choice={'type': 'function', 'function': {'name': 'get_time'}})
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ['get_time']
        assert isinstance(json.loads(calls[0].function.arguments)['zone'], str)
    assert_clean(srv)


def test_auto_choice_streams_as_it_answers(client, srv):
    """With tool_choice "auto" the model decides; streamed or not, the reply splits the same way."""
    for content in ['What is the capital of France?', 'Call get_weather for Paris.']:
        kw = dict(model=MODEL, messages=[{'role': 'user', 'content': content}], tools=[WEATHER], temperature=0,
                  max_tokens=48)
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        text, calls, reason = _streamed(client, **kw)
        assert (text or None) == (msg.content or None)
        assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments)
                                                 for c in msg.tool_calls or []]
        assert reason == r.choices[0].finish_reason
        assert reason != 'stop' or not msg.tool_calls  # a reply with calls that ends by itself: 'tool_calls'
    # tool_choice "none": the tools are not described and nothing is parsed
    plain = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24)
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice='none',
                                          temperature=0, max_tokens=24)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert_clean(srv)


def test_tool_results_go_back_into_the_conversation(client, srv):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice='required',
                                           temperature=0, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {'role': 'tool', 'tool_call_id': call.id, 'content': 'Sunny and 23 degrees celsius.'}]
    ids = srv.gateway.encode_prompt(history, tools=[WEATHER], tool_format=srv.state.tool_format())
    prompt = srv.gateway.tokenizer.decode(ids)
    assert call.function.arguments in prompt and 'Sunny and 23 degrees celsius.' in prompt
    assert prompt.index('Paris today') < prompt.index(call.function.arguments) < prompt.index('Sunny and 23')
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0,
                                            max_tokens=40)
    assert second.usage.prompt_tokens == len(ids)
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    assert_clean(srv)


def test_mixed_batch_each_as_alone(client, srv):
    """Greedy: tools and plain chat, a JSON schema, n=1 and n=3, in flight together, each gets what it gets
    alone."""
    bodies = [
        dict(messages=ASK, tools=[WEATHER, TIME], tool_choice='required'),
        dict(messages=ASK, tools=[WEATHER], tool_choice={'type': 'function', 'function': {'name': 'get_weather'}}),
        dict(messages=[{'role': 'user', 'content': 'What is the capital of France?'}]),
        dict(messages=[{'role': 'user', 'content': 'Name a color.'}], n=3),
        dict(messages=ASK, response_format={'type': 'json_schema', 'json_schema': {
            'name': 'w', 'schema': WEATHER['function']['parameters']}}),
    ]

    def ask(body):
        r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, **body)
        return [(c.message.content, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
                 c.finish_reason) for c in r.choices]

    alone = [ask(b) for b in bodies]
    assert alone[0][0][1] and alone[1][0][1][0][0] == 'get_weather' and 'Paris' in alone[2][0][0]
    together = [None] * len(bodies)

    def run(i):
        together[i] = ask(bodies[i])
    threads = [threading.Thread(target=run, args=(i, )) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    assert_clean(srv)
