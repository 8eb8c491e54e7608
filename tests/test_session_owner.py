"""A /generate session belongs to the client that made it: another API key, or a client without the
session's token, can neither read, continue, cancel nor end it, and learns nothing about it (its answers
equal those for a session that does not exist). One engine (SmolLM2-135M on cpu) behind two servers: one
with two API keys, one without keys."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip('httpx')
pytest.importorskip('fastapi')
pytest.importorskip('uvicorn')

KEY_A, KEY_B = 'sk-alice', 'sk-bob'
A = {'Authorization': f'Bearer {KEY_A}'}
B = {'Authorization': f'Bearer {KEY_B}'}
SECRET = 'My secret password is PINEAPPLE-42. Remember it.'
GREEDY = dict(temperature=0, request_output_len=12)


@pytest.fixture(scope='module')
def servers(smollm2_path):
    from lmdeploy.frontend.gateway import Gateway
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.serve.openai.api_server import BackgroundServer, create_app
    gateway = Gateway(smollm2_path, PytorchEngineConfig(device_type='cpu', session_len=1024, num_gpu_blocks=64),
                      model_name='smollm2')
    keyed_app, open_app = create_app(gateway, api_keys=[KEY_A, KEY_B]), create_app(gateway)
    keyed, open_ = BackgroundServer(keyed_app).start(), BackgroundServer(open_app).start()
    yield SimpleNamespace(keyed=keyed.url, open=open_.url, engine=gateway.engine,
                          keyed_state=keyed_app.state.lmdeploy, open_state=open_app.state.lmdeploy)
    keyed.stop(10)
    open_.stop(10)
    gateway.close()


def post(url, headers=None, **body):
    return httpx.post(url + '/generate', json=body, headers=headers, timeout=120)


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.02)


def assert_no_session_left(servers):
    """Every session ended: none in either server's table, no idle engine session, no KV block held."""
    assert servers.engine.wait_idle(30)
    servers.engine.check_invariants()
    stats = servers.engine.stats()
    assert stats.num_idle_sessions == 0 and stats.num_free_blocks == stats.num_blocks, stats
    assert len(servers.keyed_state.sessions) == 0 and len(servers.open_state.sessions) == 0


def run_in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault('r', fn()), daemon=True)
    t.start()
    return t, out


# ------------------------------------------------------------------ the session table
def test_sessions_table_finds_only_the_owners_session():
    from lmdeploy.serve.openai.sessions import _Session, Sessions
    table = Sessions()
    a, b, anon = _Session(1, 4242, b'alice'), _Session(2, 4242, b'bob'), _Session(3, 4242, None)
    for s in (a, b, anon):
        table.add(s)
    assert a.token != b.token != anon.token and len(a.token) >= 32
    assert table.find(b'alice', 4242) is a and table.find(b'bob', 4242) is b
    assert table.find(b'carol', 4242) is None
    assert table.find(None, 4242) is None  # without keys an id alone reaches nothing
    assert table.find(None, 4242, anon.token) is anon and table.find(None, -1, anon.token) is anon
    assert table.find(b'bob', 4242, a.token) is None  # another key's token
    assert table.find(b'alice', 7, a.token) is None  # a token and an id that disagree
    assert table.find(None, 4242, a.token) is None
    # server-picked ids skip those the owner uses, not other owners'
    start = table.auto_id(b'alice')
    table.add(_Session(4, start + 1, b'alice'))
    assert table.auto_id(b'alice') == start + 2
    table.remove(a)
    assert table.find(b'alice', 4242) is None and table.find(b'alice', 4242, a.token) is None
    assert table.find(b'bob', 4242) is b


# ------------------------------------------------------------------ two keys
def test_another_key_cannot_read_a_session(servers):
    url = servers.keyed
    first = post(url, A, prompt=SECRET, session_id=4242, interactive_mode=True, **GREEDY).json()
    assert first['session_id'] == 4242 and first['history_tokens'] == 0 and first['session_token']
    # B's 4242 is B's own, fresh session: its answer is the one a never-used id gets
    probe = dict(prompt='What did I just tell you?', interactive_mode=True, **GREEDY)
    theirs = post(url, B, session_id=4242, **probe).json()
    fresh = post(url, B, session_id=999, **probe).json()
    assert theirs['history_tokens'] == 0 and theirs['input_tokens'] == fresh['input_tokens']
    assert theirs['text'] == fresh['text'] and theirs['session_token'] != first['session_token']
    # two owners' 4242 are two engine sessions
    state = servers.keyed_state
    sa = state.sessions.find(state.key_digest(KEY_A), 4242)
    sb = state.sessions.find(state.key_digest(KEY_B), 4242)
    assert sa.internal_id != sb.internal_id
    assert servers.engine.wait_idle(10) and servers.engine.stats().num_idle_sessions == 3
    # A's token under B's key: answered as a token that never existed
    stolen = post(url, B, session_id=4242, session_token=first['session_token'], **probe)
    unknown = post(url, B, session_id=4242, session_token='x' * 32, **probe)
    assert stolen.status_code == unknown.status_code == 404 and stolen.json() == unknown.json()
    assert stolen.json()['error']['code'] == 'session_not_found'
    # A's history is intact: A's next turn holds it
    again = post(url, A, prompt='What is it?', session_id=4242, interactive_mode=True, **GREEDY).json()
    assert again['history_tokens'] >= first['input_tokens'] + first['tokens']
    for headers, sid in ((A, 4242), (B, 4242), (B, 999)):
        assert post(url, headers, session_id=sid, end_session=True).status_code == 200
    assert_no_session_left(servers)


def test_another_key_cannot_cancel_or_end_a_session(servers):
    url = servers.keyed
    first = post(url, A, prompt=SECRET, session_id=5151, interactive_mode=True, **GREEDY).json()
    # A's long turn runs while B tries to cancel, end and take over 5151
    t, out = run_in_thread(lambda: post(url, A, prompt='Count to one hundred.', session_id=5151,
                                        interactive_mode=True, temperature=0, request_output_len=600,
                                        ignore_eos=True).json())
    wait_for(lambda: servers.engine.stats().num_running == 1, 30, "A's turn to start")
    cancel = post(url, B, session_id=5151, cancel=True)
    cancel_none = post(url, B, session_id=123456, cancel=True)
    assert cancel.status_code == cancel_none.status_code == 200
    assert {**cancel.json(), 'session_id': 0} == {**cancel_none.json(), 'session_id': 0}
    end = post(url, B, session_id=5151, end_session=True)
    assert end.status_code == 200 and end.json()['finish_reason'] == 'stop'
    # no session_busy for B: its 5151 is its own (and it runs after the engine took B's cancel and end)
    mine = post(url, B, prompt='Hello', session_id=5151, **GREEDY)
    assert mine.status_code == 200 and mine.json()['history_tokens'] == 0
    assert t.is_alive() and servers.engine.stats().num_running == 1  # A's turn goes on
    # A itself is told its session is busy, and can cancel the turn; the session keeps both turns
    busy = post(url, A, prompt='Hello', session_id=5151, **GREEDY)
    assert busy.status_code == 400 and busy.json()['error']['code'] == 'session_busy'
    assert post(url, A, session_id=5151, cancel=True).status_code == 200
    t.join(120)
    turn = out['r']
    assert turn['finish_reason'] == 'abort' and 0 < turn['tokens'] < 600
    assert turn['history_tokens'] >= first['input_tokens'] + first['tokens']
    after = post(url, A, prompt='Go on.', session_id=5151, interactive_mode=True, **GREEDY).json()
    assert after['history_tokens'] >= turn['input_tokens'] + turn['tokens']
    assert post(url, A, session_id=5151, end_session=True).status_code == 200
    assert_no_session_left(servers)


# ------------------------------------------------------------------ no keys: the token
def test_without_keys_only_the_token_reaches_a_session(servers):
    url = servers.open
    first = post(url, prompt=SECRET, session_id=4242, interactive_mode=True, **GREEDY).json()
    token = first['session_token']
    # the same id without the token is a new session, never A's: no session_busy, no history
    t, out = run_in_thread(lambda: post(url, prompt='Count to fifty.', session_id=4242, session_token=token,
                                        interactive_mode=True, temperature=0, request_output_len=600,
                                        ignore_eos=True).json())
    wait_for(lambda: servers.engine.stats().num_running == 1, 30, "A's turn to start")
    assert post(url, session_id=4242, cancel=True).status_code == 200
    assert post(url, session_id=4242, end_session=True).status_code == 200
    other = post(url, prompt='What did I just tell you?', session_id=4242, **GREEDY)
    assert other.status_code == 200 and other.json()['history_tokens'] == 0
    assert t.is_alive() and servers.engine.stats().num_running == 1  # A's turn goes on
    assert post(url, session_token=token, cancel=True).status_code == 200
    t.join(120)
    assert out['r']['finish_reason'] == 'abort' and out['r']['session_token'] == token
    assert out['r']['history_tokens'] >= first['input_tokens'] + first['tokens']
    # a token alone (session_id -1) reaches it too; a wrong one is a 404, and ends nothing
    wrong = post(url, prompt='Hi', session_id=4242, session_token=token[::-1], **GREEDY)
    assert wrong.status_code == 404 and wrong.json()['error']['code'] == 'session_not_found'
    third = post(url, prompt='And now?', session_token=token, interactive_mode=True, **GREEDY).json()
    assert third['session_id'] == 4242 and third['history_tokens'] > out['r']['history_tokens']
    assert post(url, session_id=4242, session_token=token, end_session=True).status_code == 200
    # ended: the token reaches nothing now
    gone = post(url, prompt='Hi', session_id=4242, session_token=token, interactive_mode=True, **GREEDY)
    assert gone.status_code == 404 and gone.json() == wrong.json()
    assert_no_session_left(servers)


def test_server_picked_ids_need_the_token_and_a_dropped_stream_frees_its_session(servers):
    url = servers.open
    a = post(url, prompt=SECRET, interactive_mode=True, **GREEDY).json()
    b = post(url, prompt=SECRET, interactive_mode=True, **GREEDY).json()
    assert a['session_id'] != b['session_id'] and a['session_token'] != b['session_token']
    guess = post(url, prompt='Hi', session_id=a['session_id'], **GREEDY).json()
    assert guess['history_tokens'] == 0
    # a stream its client drops ends the session (and frees its cache)
    with httpx.stream('POST', url + '/generate', timeout=120, json=dict(
            prompt='Tell me a long story.', session_token=a['session_token'], interactive_mode=True,
            stream=True, temperature=0, request_output_len=800, ignore_eos=True)) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    wait_for(lambda: len(servers.open_state.sessions) == 1, 10, 'the dropped session to end')
    assert post(url, prompt='Hi', session_token=a['session_token'], **GREEDY).status_code == 404
    assert post(url, session_token=b['session_token'], end_session=True).status_code == 200
    assert_no_session_left(servers)


# ------------------------------------------------------------------ the project's clients
def test_api_client_carries_the_token(servers):
    from lmdeploy.serve.client import APIClient
    with APIClient(servers.open) as alice, APIClient(servers.open) as mallory:
        first = next(alice.generate(SECRET, session_id=7, interactive_mode=True, **GREEDY))
        second = next(alice.generate('What is it?', session_id=7, interactive_mode=True, **GREEDY))
        assert second['history_tokens'] >= first['input_tokens'] + first['tokens']
        assert next(mallory.generate('What is it?', session_id=7, **GREEDY))['history_tokens'] == 0
        mallory.end_session(7)
        third = list(alice.generate('Once more.', session_id=7, interactive_mode=True, stream=True, **GREEDY))
        assert third[-1]['history_tokens'] > second['history_tokens']
        alice.end_session(7)
    assert_no_session_left(servers)


def test_gradio_remote_backend_keeps_tabs_apart_and_stops_early(servers):
    from lmdeploy.serve.gradio.backend import ChatSession, ChatSettings
    from lmdeploy.serve.gradio.remote import RemoteBackend
    backend = RemoteBackend(servers.open)
    try:
        one, two = ChatSession(session_id=31), ChatSession(session_id=31)  # the same id: two conversations
        settings = ChatSettings(max_new_tokens=8, temperature=0)
        assert ''.join(backend.stream(one, SECRET, settings))
        assert ''.join(backend.stream(two, 'Hello!', settings))
        assert one.session_token and two.session_token and one.session_token != two.session_token
        ctx_one = one.context_tokens
        assert ''.join(backend.stream(one, 'What is it?', settings)) and one.turns == 2
        assert one.input_tokens > ctx_one  # the first turn is in the context of the second
        # stop pressed before the server's first answer: the turn is cancelled once the token comes
        long = ChatSession()
        pieces = []
        worker = threading.Thread(target=lambda: pieces.extend(
            backend.stream(long, 'Tell me a long story.', ChatSettings(max_new_tokens=600, temperature=0))))
        worker.start()
        wait_for(lambda: long.generating, 10, 'the turn to start')
        backend.stop(long)
        worker.join(60)
        assert not worker.is_alive() and long.finish_reason == 'abort' and long.generated_tokens < 600
        assert long.turns == 1 and long.session_token  # kept, as a stop keeps the partial answer
        for s in (one, two, long):
            backend.reset(s)
            assert s.session_token is None and s.session_id is None
    finally:
        backend.close()
    assert_no_session_left(servers)
