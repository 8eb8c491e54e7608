"""The rest of what OpenAI clients send, through the API server (SmolLM2 on cpu, the unmodified ``openai``
client, one server for the module): the deprecated ``functions`` / ``function_call`` (answered in their
legacy shape, their turns rendered as tool turns), ``GET /v1/models/{id}``, and ``response_format`` beside
tools (a forced call follows its function's schema; with "auto" the reply is a call or text in the format).

The requests of a test go in flight together, so the engine batches them (a seeded reply does not depend on
its batch: test_server_tools.test_mixed_batch_each_as_alone); the seeds and the names are drawn at random
and said in each assertion's message."""
from __future__ import annotations

import json
import random
import string
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')
jsonschema = pytest.importorskip('jsonschema')
pytest.importorskip('xgrammar')

from test_server import KEY, MODEL, assert_clean, start_server, stop_server  # noqa: E402

# (short bounds: a sampled 135M model writes strings up to them, and every token costs the test time)
FUNCTIONS = [
    {'name': 'get_weather', 'description': 'The current weather in a city', 'parameters': {
        'type': 'object', 'properties': {'city': {'type': 'string', 'maxLength': 12},
                                         'unit': {'type': 'string', 'enum': ['celsius', 'fahrenheit']}},
        'required': ['city', 'unit']}},
    {'name': 'get_time', 'description': 'The time in a time zone', 'parameters': {
        'type': 'object', 'properties': {'zone': {'type': 'string', 'maxLength': 16}}, 'required': ['zone']}}]
TOOLS = [{'type': 'function', 'function': f} for f in FUNCTIONS]
ASK = [{'role': 'user', 'content': 'What is the weather like in Paris today?'}]
SCHEMAS = {f['name']: f['parameters'] for f in FUNCTIONS}
CHAT = '/v1/chat/completions'
# a format no call's arguments satisfy (they are checked against their function's schema, not this one)
ANSWER = {'type': 'object', 'properties': {'answer': {'type': 'string', 'maxLength': 12}}, 'required': ['answer'],
          'additionalProperties': False}
ANSWER_FORMAT = {'type': 'json_schema', 'json_schema': {'name': 'answer', 'schema': ANSWER}}


@pytest.fixture(scope='module')
def srv(smollm2_path):
    s = start_server(smollm2_path)
    yield s
    stop_server(s)


@pytest.fixture(scope='module')
def client(srv):
    return openai.OpenAI(base_url=srv.url + '/v1', api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope='module')
def http(srv):
    with httpx.Client(base_url=srv.url, headers={'Authorization': f'Bearer {KEY}'}, timeout=600) as c:
        yield c


@pytest.fixture
def rng(request):
    seed = random.randrange(1 << 30)
    print(f'{request.node.name}: random seed {seed}')
    return random.Random(seed)


def _together(*calls):
    """Run (function, kwargs) pairs at once; their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(f, **kw) for f, kw in calls]
        return [f.result() for f in futures]


def _streamed_function_call(client, **kw):
    """Text, (name, arguments) and finish reason of a streamed legacy reply, checking the deltas' shape:
    the call's first delta has its name (and arguments ""), the later ones only pieces of arguments; no
    delta carries tool_calls."""
    text, name, args, reason = '', None, None, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert c.delta.tool_calls is None, c.delta
            text += c.delta.content or ''
            reason = c.finish_reason or reason
            fc = c.delta.function_call
            if fc is None:
                continue
            if name is None:
                assert fc.name and fc.arguments == '', fc
                name, args = fc.name, ''
            else:
                assert fc.name is None and fc.arguments, fc
                args += fc.arguments
    return text, (name, args), reason


def test_named_function_call_legacy_shape(client, srv, rng):
    """function_call naming a function, sampled: message.function_call with that name and arguments valid
    against its parameters, no tool_calls, finish_reason "function_call"; the same seed streamed gives the
    same call in delta.function_call pieces."""
    cases = [(rng.choice(FUNCTIONS)['name'], rng.randrange(1 << 31)) for _ in range(3)]

    def kw(name, seed):
        return dict(model=MODEL, messages=ASK, functions=FUNCTIONS, function_call={'name': name}, temperature=1.0,
                    seed=seed, max_tokens=60)

    results = _together(*[(client.chat.completions.create, kw(*c)) for c in cases],
                        *[(_streamed_function_call, dict(client=client, **kw(*c))) for c in cases])
    for i, (name, seed) in enumerate(cases):
        r, (text, call, reason) = results[i], results[len(cases) + i]
        msg, why = r.choices[0].message, (name, seed)
        assert msg.tool_calls is None and not (msg.content or '').strip(), (why, msg)
        assert msg.function_call.name == name and r.choices[0].finish_reason == 'function_call', (why, r)
        jsonschema.validate(json.loads(msg.function_call.arguments), SCHEMAS[name])
        assert call == (name, msg.function_call.arguments) and reason == 'function_call' and not text.strip(), why
    assert_clean(srv)


def test_function_call_none_and_auto(client, http, srv):
    """function_call "none": the functions are not described and the reply is text, as without them; "auto"
    (the default with functions): text, or one call in the legacy shape, streamed or not alike."""
    plain = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=16)
    auto = dict(model=MODEL, messages=[{'role': 'user', 'content': 'Call get_time for Europe/Paris.'}],
                functions=FUNCTIONS, temperature=0, max_tokens=32)
    base, none, full, (text, call, reason), raw = _together(
        (client.chat.completions.create, plain),
        (client.chat.completions.create, dict(plain, functions=FUNCTIONS, function_call='none')),
        (client.chat.completions.create, auto), (_streamed_function_call, dict(client=client, **auto)),
        (http.post, dict(url=CHAT, json=dict(auto, function_call={'name': 'get_time'}))))
    assert none.choices[0].message.content == base.choices[0].message.content
    assert none.choices[0].message.function_call is None and none.usage.prompt_tokens == base.usage.prompt_tokens
    msg = full.choices[0].message
    assert msg.tool_calls is None
    if msg.function_call is not None:
        assert msg.function_call.name in SCHEMAS and full.choices[0].finish_reason in ('function_call', 'length')
        assert call == (msg.function_call.name, msg.function_call.arguments)
    else:
        assert call == (None, None) and full.choices[0].finish_reason != 'function_call'
    assert (text or None) == (msg.content or None) and reason == full.choices[0].finish_reason
    raw = raw.json()
    message = raw['choices'][0]['message']  # the wire shape: function_call, and tool_calls null
    assert message['tool_calls'] is None and set(message['function_call']) == {'name', 'arguments'}, raw
    assert_clean(srv)


def test_function_turns_render_as_tool_turns(client, http, srv, rng):
    """An assistant turn's function_call and a role "function" result reach the prompt as the tool-call and
    tool-result turns they stand for: the server's prompt is the one the tools' shape renders (same
    tokens), holding the call's arguments and then the result."""
    city = ''.join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 10))).title()
    arguments = json.dumps({'city': city, 'unit': rng.choice(['celsius', 'fahrenheit'])})
    result = f'{rng.choice(["Sunny", "Rainy", "Foggy"])} and {rng.randint(-10, 40)} degrees.'
    ask = [{'role': 'user', 'content': f'What is the weather like in {city} today?'}]
    old = ask + [{'role': 'assistant', 'content': None, 'function_call': {'name': 'get_weather',
                                                                           'arguments': arguments}},
                 {'role': 'function', 'name': 'get_weather', 'content': result}]
    new = ask + [{'role': 'assistant', 'content': None, 'tool_calls': [{
        'id': 'call_1', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': arguments}}]},
        {'role': 'tool', 'tool_call_id': 'call_1', 'name': 'get_weather', 'content': result}]
    ids = srv.gateway.encode_prompt(new, tools=TOOLS, tool_format=srv.state.tool_format())
    prompt = srv.gateway.tokenizer.decode(ids)
    assert prompt.index(f'{city} today') < prompt.index(arguments) < prompt.index(result), prompt
    kw = dict(model=MODEL, temperature=0, max_tokens=24)
    a, b, g, c = _together((client.chat.completions.create, dict(kw, messages=old, functions=FUNCTIONS)),
                           (client.chat.completions.create, dict(kw, messages=new, tools=TOOLS)),
                           (http.post, dict(url='/generate', json=dict(prompt=old, request_output_len=1))),
                           (client.chat.completions.create, dict(model=MODEL, messages=old, max_tokens=1)))
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(ids)
    fa, tb = a.choices[0].message.function_call, b.choices[0].message.tool_calls
    assert a.choices[0].message.content == b.choices[0].message.content
    assert (fa and (fa.name, fa.arguments)) == (tb and (tb[0].function.name, tb[0].function.arguments))
    # without functions (and in /generate) the turns still render, as the tool turns do
    bare = srv.gateway.encode_prompt(new)
    assert result in srv.gateway.tokenizer.decode(bare)
    g = g.json()
    assert g['input_tokens'] == c.usage.prompt_tokens == len(bare), (g, c.usage)
    assert_clean(srv)


def test_deprecated_and_current_forms_do_not_mix(http):
    """tools beside functions (or either choice beside the other form) is a 400 naming the deprecated field;
    a function_call naming no function of functions is a 400 in functions' words."""
    for extra, param in ((dict(tools=TOOLS, functions=FUNCTIONS), 'functions'),
                         (dict(tools=TOOLS, function_call='auto'), 'function_call'),
                         (dict(functions=FUNCTIONS, tool_choice='auto'), 'functions'),
                         (dict(function_call='none', tool_choice='none'), 'function_call')):
        r = http.post(CHAT, json=dict(model=MODEL, messages='hi', **extra))
        err = r.json()['error']
        assert r.status_code == 400 and (err['code'], err['param']) == ('invalid_value', param), (extra, err)
        assert 'cannot be combined' in err['message'], err
    for extra in (dict(functions=FUNCTIONS, function_call={'name': 'get_news'}), dict(function_call={'name': 'f'})):
        r = http.post(CHAT, json=dict(model=MODEL, messages='hi', **extra))
        err = r.json()['error']
        assert r.status_code == 400 and err['param'] == 'function_call', err
        assert 'functions' in err['message'] and 'tool' not in err['message'], err
    r = http.post(CHAT, json=dict(model=MODEL, messages='hi', functions=FUNCTIONS * 2))
    assert r.status_code == 400 and r.json()['error']['param'] == 'functions', r.text


def test_models_retrieve(client, srv, rng):
    """GET /v1/models/{id}: the entry of GET /v1/models for the served name; any other id a 404
    model_not_found; behind the same API key."""
    listed = client.models.list().data
    got = client.models.retrieve(MODEL)
    assert [got.model_dump()] == [m.model_dump() for m in listed] and got.id == MODEL and got.object == 'model'
    other = ''.join(rng.choice(string.ascii_letters + string.digits + '-._') for _ in range(rng.randint(1, 20)))
    for name in (other, MODEL + 'x', f'org/{MODEL}'):
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(name)
        assert (e.value.body['code'], e.value.body['param'], e.value.body['type']) == (
            'model_not_found', 'model', 'invalid_request_error'), (name, e.value.body)
        assert repr(name) in e.value.body['message'] and MODEL in e.value.body['message']
    for headers in ({}, {'Authorization': 'Bearer sk-wrong'}):
        r = httpx.get(f'{srv.url}/v1/models/{MODEL}', headers=headers)
        assert r.status_code == 401 and r.json()['error']['code'] == 'invalid_api_key', r.text
    bad = openai.OpenAI(base_url=srv.url + '/v1', api_key='sk-wrong', max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.retrieve(MODEL)


def test_response_format_beside_tools(client, srv, rng):
    """A response_format governs a reply's text: a forced call (tool_choice "required", a named function, the
    deprecated function_call naming one) is taken (200) and follows its function's schema, not the format;
    with tool_choice "auto" the reply is either calls valid against their schemas or text in the format."""
    name = rng.choice(FUNCTIONS)['name']
    base = dict(model=MODEL, messages=ASK, response_format=ANSWER_FORMAT, temperature=1.0, max_tokens=60)
    forced = [dict(base, tools=TOOLS, tool_choice='required', parallel_tool_calls=False),
              dict(base, tools=TOOLS, tool_choice={'type': 'function', 'function': {'name': name}}),
              dict(base, functions=FUNCTIONS, function_call={'name': name})]
    auto = [dict(base, tools=TOOLS, parallel_tool_calls=False,
                 messages=[{'role': 'user', 'content': rng.choice(['Call get_time for Asia/Tokyo.', ASK[0]['content'],
                                                                   'Answer in JSON: what is 2 + 2?'])}])
            for _ in range(2)]
    seeds = [rng.randrange(1 << 31) for _ in forced + auto]
    replies = _together(*[(client.chat.completions.create, dict(kw, seed=s)) for kw, s in zip(forced + auto, seeds)])
    for i, r in enumerate(replies[:len(forced)]):
        msg, why = r.choices[0].message, (i, seeds[i])
        calls = [msg.function_call] if i == 2 else [c.function for c in msg.tool_calls or []]
        assert len(calls) == 1 and not (msg.content or '').strip(), (why, msg)
        assert r.choices[0].finish_reason == ('function_call' if i == 2 else 'tool_calls'), (why, r)
        assert i == 0 or calls[0].name == name, (why, msg)
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    for j, r in enumerate(replies[len(forced):]):
        msg, reason, why = r.choices[0].message, r.choices[0].finish_reason, seeds[len(forced) + j]
        if msg.tool_calls:
            assert len(msg.tool_calls) == 1 and reason == 'tool_calls' and not (msg.content or '').strip(), (why, r)
            call = msg.tool_calls[0].function
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        else:
            assert reason == 'stop', (why, r)
            jsonschema.validate(json.loads(msg.content), ANSWER)
    # every call format's grammar joins the format's ("or"): taken under each (one token is enough to know)
    from lmdeploy.frontend.tool_calls import FORMATS
    saved = srv.state._tool_format
    try:
        for fmt in FORMATS.values():
            srv.state._tool_format = fmt
            r = client.chat.completions.create(**dict(auto[0], max_tokens=1, seed=seeds[-1]))
            assert r.choices[0].finish_reason == 'length', (fmt.name, r)
    finally:
        srv.state._tool_format = saved
    assert_clean(srv)
