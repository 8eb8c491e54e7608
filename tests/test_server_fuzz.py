"""Fuzz the server's OpenAPI schema with schemathesis, every built-in check (``--checks all``): for
every operation, bodies the schema allows (positive) and bodies it forbids (negative); no 5xx, every
status, content type and body as documented, every allowed body taken (2xx) and every forbidden one
refused (4xx). The schema is the one the server serves (the loaded model's name and vocabulary in it).

Generation lengths are clamped (a 135M model on a small CPU). What no JSON schema can say is made true
of the allowed bodies before they are sent (``_reachable``): function names unique among the tools (or
the deprecated functions), a named tool_choice (function_call) naming one of them, their parameters a
usable JSON schema (whose text fits the context), a response_format xgrammar compiles, a raw prompt the
tokenizer makes at least one token of. Everything else is as schemathesis generates it."""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip('schemathesis')
hypothesis = pytest.importorskip('hypothesis')
pytest.importorskip('openai')  # test_server's dependencies

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import CHECKS, load_all_checks  # noqa: E402

from test_server import KEY, assert_clean, start_server, stop_server  # noqa: E402

MAX_EXAMPLES = 15
MAX_NEW_TOKENS = 2
FUZZ_SESSION_LEN = 8192  # SmolLM2's context
LENGTH_FIELDS = ('max_tokens', 'max_completion_tokens', 'request_output_len')
GENERATING = ('/v1/chat/completions', '/v1/completions', '/generate')


@pytest.fixture(scope='module')
def srv(smollm2_path):
    # the model's whole context: how many tokens a generated text makes is no schema's to say, and
    # hypothesis's texts (many code points, each several bytes) run to a few thousand
    s = start_server(smollm2_path, session_len=FUZZ_SESSION_LEN)
    yield s
    stop_server(s)


def _whole_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == int(value)


def _reachable(body: dict, path: str, positive: bool, gateway):
    """Clamp generation lengths; for an allowed body, also what the schema cannot say (see the docstring).
    A forbidden body keeps what makes it forbidden (a negative case may break a header, not the body):
    lengths are only lowered, from whole numbers above the clamp (valid ones) to the clamp."""
    for name in LENGTH_FIELDS:
        value = body.get(name)
        if _whole_number(value) and value > MAX_NEW_TOKENS:
            body[name] = MAX_NEW_TOKENS
    # no length given: one (a field that may be left out, given a valid value, makes no body valid)
    given = [name for name in LENGTH_FIELDS if body.get(name) is not None]
    if not given:
        body['request_output_len' if path == '/generate' else 'max_tokens'] = MAX_NEW_TOKENS
    if not positive:
        return
    # tools (function objects under "function"), or the deprecated functions (the schema allows one of them)
    for key, choice_key, nested in (('tools', 'tool_choice', True), ('functions', 'function_call', False)):
        tools = body.get(key)
        if isinstance(tools, list) and tools:
            for i, tool in enumerate(tools):
                function = tool['function'] if nested else tool
                function['name'] = f'f{i}'
                # a random object is seldom a JSON schema xgrammar can compile, and its text in the prompt may
                # not fit the context
                function['parameters'] = {'type': 'object', 'properties': {'x': {'type': 'integer'}}}
            choice = body.get(choice_key)
            if isinstance(choice, dict):
                (choice['function'] if nested else choice)['name'] = 'f0'
    fmt = body.get('response_format')
    if isinstance(fmt, dict) and not _compiles(gateway, fmt):
        body['response_format'] = {'type': 'json_object'} if _compiles(gateway, {'type': 'json_object'}) else None
    # a text the tokenizer makes nothing of (it drops some control characters) is no prompt
    if path == '/v1/completions' or (path == '/generate' and body.get('do_preprocess') is False):
        prompt = body.get('prompt')
        if isinstance(prompt, str) and prompt and not gateway.tokenizer.encode(prompt):
            body['prompt'] = prompt + '.'
        elif isinstance(prompt, list):
            body['prompt'] = [p + '.' if isinstance(p, str) and not gateway.tokenizer.encode(p) else p
                              for p in prompt]


def _compiles(gateway, fmt: dict) -> bool:
    """Whether xgrammar compiles this response_format (no schema can say which regexes and JSON schemas it
    takes)."""
    from lmdeploy.engine.grammar import spec_from_response_format
    try:
        spec = spec_from_response_format(fmt)
        if spec is not None:
            gateway.grammars().compile(spec)
        return True
    except ValueError:  # (xgrammar missing, or the grammar is not one it takes)
        return False


def _failures(case, response, headers, base_url) -> list:
    """Every check's failure for this response (collected, not raised: a raise would make hypothesis
    shrink against the live server)."""
    try:
        case.validate_response(response, checks=CHECKS.get_all(), headers=headers,
                               transport_kwargs={'base_url': base_url, 'headers': headers})
    except BaseException as e:  # noqa: B902 - schemathesis raises a FailureGroup (an exception group)
        return [f'{type(f).__name__}: {str(f)[:600]}' for f in getattr(e, 'exceptions', [e])]
    return []


@pytest.mark.parametrize('mode', ['positive', 'negative'])
def test_fuzz_openapi_all_checks(srv, mode):
    load_all_checks()
    schema = schemathesis.openapi.from_dict(srv.app.openapi())
    positive = mode == 'positive'
    generation_mode = schemathesis.GenerationMode.POSITIVE if positive else schemathesis.GenerationMode.NEGATIVE
    headers = {'Authorization': f'Bearer {KEY}'}
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {'/v1/models', '/v1/chat/completions', '/v1/completions', '/generate',
                                              '/health', '/metrics'}
    tested, statuses, failures = 0, {}, {}
    for op in operations:
        if not positive and op.method.upper() != 'POST':
            continue  # nothing to break in a GET without parameters

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=op.as_strategy(generation_mode))
        def run(case):
            if isinstance(case.body, dict):
                _reachable(case.body, op.path, positive, srv.gateway)
            response = case.call(base_url=srv.url, headers=headers, timeout=120)
            statuses[(op.path, response.status_code)] = statuses.get((op.path, response.status_code), 0) + 1
            for failure in _failures(case, response, headers, srv.url):
                failures.setdefault((op.path, failure.split('\n')[0]), (case.body, response.text[:300], failure))

        run()
        tested += 1
    report = '\n\n'.join(f'{path} {body!r:.400}\n-> {answer}\n{failure}'
                           for (path, _), (body, answer, failure) in failures.items())
    assert not failures, f'{len(failures)} kinds of violation:\n{report}'
    assert tested >= (3 if mode == 'negative' else 6)
    if positive:  # valid bodies do reach the engine
        assert sum(n for (path, status), n in statuses.items() if status == 200 and path in GENERATING) >= 30
    else:  # invalid ones are refused (schemathesis excuses the few whose fault is in a header, not the body)
        # (how many of hypothesis's cases break the body rather than a header varies with its version)
        refused = {path: sum(n for (p, status), n in statuses.items() if p == path and status == 400)
                   for path, _ in statuses}
        assert all(refused.values()), statuses
        assert sum(refused.values()) >= sum(statuses.values()) // 4, statuses
    # fuzzed interactive sessions stay open: end them, then nothing may be left behind
    srv.state.sessions.end_all(srv.gateway)
    assert_clean(srv, timeout=60)
