"""Fuzz the server's OpenAPI schema with schemathesis: valid and invalid bodies
for every operation; no answer may be a 5xx, and every error is OpenAI-shaped.

Generation lengths are clamped (a 135M model on a small CPU); everything else
is as schemathesis generates it."""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip('schemathesis')
hypothesis = pytest.importorskip('hypothesis')
pytest.importorskip('openai')  # test_server's dependencies

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from test_server import KEY, assert_clean, start_server, stop_server  # noqa: E402

MAX_EXAMPLES = 20
MAX_NEW_TOKENS = 2
LENGTH_FIELDS = ('max_tokens', 'max_completion_tokens', 'request_output_len')


@pytest.fixture(scope='module')
def srv(smollm2_path):
    s = start_server(smollm2_path)
    yield s
    stop_server(s)


def _clamp(case, model=None):
    body = getattr(case, 'body', None)
    if not isinstance(body, dict):
        return
    path = case.operation.path
    if model is not None and 'model' in body:  # reach past the model check
        body['model'] = model
    if path in ('/v1/chat/completions', '/v1/completions', '/generate'):
        for name in LENGTH_FIELDS:
            value = body.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_NEW_TOKENS:
                body[name] = MAX_NEW_TOKENS
        if path == '/generate':
            if body.get('request_output_len') is None:
                body['request_output_len'] = MAX_NEW_TOKENS
        elif body.get('max_tokens') is None and body.get('max_completion_tokens') is None:
            body['max_tokens'] = MAX_NEW_TOKENS


def _check(case, response):
    assert response.status_code < 500, (case.operation.path, case.body, response.status_code, response.text[:500])
    if response.status_code >= 400:
        err = response.json()['error']
        assert set(err) >= {'message', 'type', 'code'}, response.text


@pytest.mark.parametrize('mode', ['positive', 'negative'])
def test_fuzz_openapi_no_5xx(srv, mode):
    schema = schemathesis.openapi.from_dict(srv.app.openapi())
    generation_mode = (schemathesis.GenerationMode.POSITIVE if mode == 'positive'
                       else schemathesis.GenerationMode.NEGATIVE)
    headers = {'Authorization': f'Bearer {KEY}'}
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {'/v1/models', '/v1/chat/completions', '/v1/completions', '/generate',
                                              '/health', '/metrics'}
    tested, statuses = 0, {}
    for op in operations:
        if mode == 'negative' and op.method.upper() != 'POST':
            continue  # nothing to break in a GET without parameters

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=op.as_strategy(generation_mode))
        def run(case):
            _clamp(case, srv.state.model_name if mode == 'positive' else None)
            response = case.call(base_url=srv.url, headers=headers, timeout=120)
            statuses[(op.path, response.status_code)] = statuses.get((op.path, response.status_code), 0) + 1
            _check(case, response)

        run()
        tested += 1
    assert tested >= (3 if mode == 'negative' else 6)
    if mode == 'positive':  # valid bodies do reach the engine
        generating = ('/v1/chat/completions', '/v1/completions', '/generate')
        assert sum(n for (path, status), n in statuses.items() if status == 200 and path in generating) >= 15
    # fuzzed interactive sessions stay open: end them, then nothing may be left behind
    srv.state.sessions.end_all(srv.gateway)
    assert_clean(srv, timeout=60)
