"""``lmdeploy serve proxy`` in front of two real api_server processes (the default model on the cpu
device), each registered through ``--proxy-url`` with the proxy's key. What a node did is read from
that node's own /metrics, not from the proxy. The servers start once for the module; the tests run
in order and the last ones pause one node (SIGSTOP, then SIGCONT), kill it (SIGKILL) and stop the
other (SIGTERM)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip('httpx')
pytest.importorskip('fastapi')
pytest.importorskip('uvicorn')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = 'sk-proxy-test'
AUTH = {'Authorization': f'Bearer {KEY}'}
MODEL = 'smollm2'
QUESTION = [{'role': 'user', 'content': 'What is the capital of France?'}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env['PYTHONPATH'] = REPO + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
    env.pop('LMDEPLOY_PROXY_API_KEY', None)
    return env


class Proc:
    """A child process (in a session of its own: killing its group takes its engine process too) whose
    output is collected."""

    def __init__(self, cmd):
        self.p = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return ''.join(self.lines)

    def kill(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(30)


def _wait(cond, timeout, what, procs=()):
    deadline = time.monotonic() + timeout
    while True:
        for proc in procs:
            if proc.p.poll() is not None:
                pytest.fail(f'{what}: a process exited with {proc.p.returncode}:\n{proc.output[-3000:]}')
        try:
            value = cond()
            if value:
                return value
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f'{what}: not within {timeout} s\n' + '\n'.join(p.output[-2000:] for p in procs))
        time.sleep(0.2)


def metric_sum(url: str, name: str) -> float:
    """A node's own counter (all label sets summed), from its /metrics."""
    total = 0.0
    for line in httpx.get(url + '/metrics', timeout=10).text.splitlines():
        if line.startswith(name + ' ') or line.startswith(name + '{'):
            total += float(line.rsplit(' ', 1)[1])
    return total


def in_flight(nodes) -> float:
    """Requests the nodes say they are handling now."""
    return sum(metric_sum(n.url, 'lmdeploy_api_requests_in_flight') for n in nodes if n.p.poll() is None)


def status(proxy) -> dict:
    r = httpx.get(proxy + '/nodes/status', headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return {n['url']: n for n in r.json()['nodes']} | {'_': r.json()}


@pytest.fixture(scope='module')
def cluster(smollm2_path, tmp_path_factory):
    port = _free_port()
    proxy_url = f'http://127.0.0.1:{port}'
    state_file = str(tmp_path_factory.mktemp('proxy') / 'nodes.json')
    proxy = Proc([sys.executable, '-m', 'lmdeploy', 'serve', 'proxy', '--server-name', '127.0.0.1', '--server-port',
                  str(port), '--api-keys', KEY, '--strategy', 'min_expected_latency', '--health-interval', '1',
                  '--drop-after', '2', '--log-level', 'INFO', '--state-file', state_file])
    proxy.state_file = state_file
    nodes = []
    try:
        _wait(lambda: httpx.get(proxy_url + '/health', timeout=2).status_code in (200, 503), 60, 'proxy up', [proxy])
        for _ in range(2):
            p = _free_port()
            node = Proc([sys.executable, '-m', 'lmdeploy.serve.openai.api_server', smollm2_path, '--server-name',
                         '127.0.0.1', '--server-port', str(p), '--device', 'cpu', '--session-len', '1024',
                         '--num-gpu-blocks', '64', '--model-name', MODEL, '--log-level', 'INFO',
                         '--proxy-url', proxy_url, '--proxy-api-key', KEY])
            node.url = f'http://127.0.0.1:{p}'
            nodes.append(node)
        urls = [n.url for n in nodes]
        _wait(lambda: all(status(proxy_url).get(u, {}).get('healthy') for u in urls), 240, 'both nodes registered',
              [proxy, *nodes])
        yield proxy_url, proxy, nodes
    finally:
        for n in nodes:
            n.kill()
        proxy.p.send_signal(signal.SIGTERM)
        try:
            proxy.p.wait(20)
        except subprocess.TimeoutExpired:
            proxy.kill()


def chat(proxy, max_tokens=4, **kw):
    body = dict(model=MODEL, messages=QUESTION, max_tokens=max_tokens, temperature=0, **kw)
    return httpx.post(proxy + '/v1/chat/completions', json=body, headers=AUTH, timeout=120)


def read_stream(lines):
    """(content text, chunks with a role, error objects, whether [DONE] came) of SSE lines."""
    text, roles, errors, done = '', 0, [], False
    for line in lines:
        if not line.startswith('data: '):
            continue
        data = line[len('data: '):]
        if data == '[DONE]':
            done = True
            continue
        obj = json.loads(data)
        if 'error' in obj:
            errors.append(obj['error'])
            continue
        for c in obj['choices']:
            roles += 'role' in c.get('delta', {})
            text += c.get('delta', {}).get('content') or ''
    return text, roles, errors, done


# ------------------------------------------------------------------------------------------ the table
def test_nodes_registered_with_their_models(cluster):
    proxy, _, nodes = cluster
    st = status(proxy)
    assert {n.url for n in nodes} <= set(st)
    for n in nodes:
        assert st[n.url]['models'] == [MODEL] and st[n.url]['state'] == 'healthy'
        batch = st[n.url]['max_batch_size']  # registered by the node: what the proxy keeps at it follows
        assert isinstance(batch, int) and batch >= 1 and st[n.url]['slots'] == batch + max(2, batch // 8)
    assert st['_']['strategy'] == 'min_expected_latency'
    r = httpx.get(proxy + '/v1/models', headers=AUTH)
    assert r.status_code == 200 and [m['id'] for m in r.json()['data']] == [MODEL]
    assert httpx.get(proxy + '/health').json()['healthy_nodes'] == 2
    with open(cluster[1].state_file) as f:  # what a restarted proxy would start from
        saved = json.load(f)['nodes']
    assert sorted(e['url'] for e in saved) == sorted(n.url for n in nodes) and saved[0]['models'] == [MODEL]


@pytest.mark.parametrize('headers', [{}, {'Authorization': 'Bearer wrong'}, {'Authorization': KEY}])
def test_registration_and_table_need_the_key(cluster, headers):
    proxy, _, nodes = cluster
    before = set(status(proxy))
    for method, path, body in (('POST', '/nodes/add', {'url': 'http://127.0.0.1:9'}),
                               ('POST', '/nodes/remove', {'url': nodes[0].url}), ('GET', '/nodes/status', None),
                               ('GET', '/v1/models', None), ('POST', '/v1/chat/completions', {'model': MODEL})):
        r = httpx.request(method, proxy + path, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (path, r.text)
        err = r.json()['error']
        assert err['code'] == 'invalid_api_key' and err['type'] == 'authentication_error'
    assert set(status(proxy)) == before


def test_bad_registration_is_a_400(cluster):
    proxy, _, _ = cluster
    for body in ({'url': 'ftp://x'}, {'url': ''}, {'models': ['m']}, {'url': 'http://127.0.0.1:9', 'speed': -1}):
        r = httpx.post(proxy + '/nodes/add', json=body, headers=AUTH)
        assert r.status_code == 400 and 'error' in r.json(), (body, r.text)
    r = httpx.post(proxy + '/nodes/remove', json={'url': 'http://127.0.0.1:9'}, headers=AUTH)
    assert r.status_code == 404 and r.json()['error']['code'] == 'node_not_found'


# ------------------------------------------------------------------------------------------- requests
def test_concurrent_requests_reach_both_nodes(cluster):
    proxy, _, nodes = cluster
    before = [metric_sum(n.url, 'lmdeploy_requests_total') for n in nodes]
    count = 6
    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(lambda _: chat(proxy), range(count)))
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()['choices'][0]['message']['content']
    served = [metric_sum(n.url, 'lmdeploy_requests_total') - b for n, b in zip(nodes, before)]
    assert sum(served) == count, served  # each request ran exactly once
    assert all(s >= 1 for s in served), served  # and on both nodes
    # the proxy's header names the node that its own /metrics says served it
    by_header = [sum(r.headers['x-lmdeploy-node'] == n.url for r in answers) for n in nodes]
    assert by_header == served
    for r in answers:  # the proxy's own date and server headers, not the node's as well
        assert len(r.headers.get_list('date')) == 1 and len(r.headers.get_list('server')) == 1, r.headers


def test_stream_passes_through_as_generated(cluster):
    proxy, _, nodes = cluster
    expected = chat(proxy, max_tokens=24, ignore_eos=True).json()['choices'][0]['message']['content']
    body = dict(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, ignore_eos=True, stream=True)
    _wait(lambda: in_flight(nodes) == 0, 10, 'the nodes idle')
    with httpx.stream('POST', proxy + '/v1/chat/completions', json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and r.headers['content-type'].startswith('text/event-stream')
        lines = r.iter_lines()
        head = []
        for line in lines:  # up to the first chunk with text
            head.append(line)
            if '"content": "' in line and '"content": ""' not in line:
                break
        # the first text is here while its node is still generating: nothing was buffered
        running = in_flight(nodes)
        rest = list(lines)
    assert running == 1
    text, roles, errors, done = read_stream([*head, *rest])
    assert done and not errors and roles == 1
    assert text == expected and 'Paris' in text


def test_completions_and_generate_stream(cluster):
    proxy, _, _ = cluster
    body = dict(model=MODEL, prompt='The capital of France is', max_tokens=6, temperature=0, stream=True)
    with httpx.stream('POST', proxy + '/v1/completions', json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith('data: ')]
    assert events[-1] == 'data: [DONE]' and len(events) >= 3
    text = ''.join(json.loads(e[6:])['choices'][0]['text'] for e in events[:-1])
    ref = httpx.post(proxy + '/v1/completions', json=dict(body, stream=False), headers=AUTH, timeout=120).json()
    assert text == ref['choices'][0]['text'] and text.strip()
    body = dict(prompt='The capital of France is', max_tokens=6, temperature=0, stream=True, do_preprocess=False)
    with httpx.stream('POST', proxy + '/generate', json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and 'ndjson' in r.headers['content-type']
        items = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert ''.join(i['text'] for i in items) == text


def test_generate_session_stays_on_its_node(cluster):
    proxy, _, nodes = cluster
    sid = 4000 + int.from_bytes(os.urandom(2), 'little')
    turn = dict(session_id=sid, interactive_mode=True, max_tokens=4, temperature=0)
    served = []
    for prompt in ('My name is Bob.', 'What is my name?', 'And where do I live?'):
        r = httpx.post(proxy + '/generate', json=dict(turn, prompt=prompt), headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        served.append(r.headers['x-lmdeploy-node'])
        # the nodes have no API keys: the session's token reaches it, its id alone would not
        turn['session_token'] = r.json()['session_token']
        assert r.json()['history_tokens'] > 0 or len(served) == 1
        # the node's own count of sessions that keep their cache between turns says where it lives
        idle = {n.url: metric_sum(n.url, 'lmdeploy_num_idle_sessions') for n in nodes}
        assert idle[served[0]] == 1 and sum(idle.values()) == 1, idle
    assert len(set(served)) == 1
    r = httpx.post(proxy + '/generate', json=dict(session_id=sid, session_token=turn['session_token'],
                                                  end_session=True), headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.headers['x-lmdeploy-node'] == served[0]
    # the node answers before its engine process takes the end off its queue
    _wait(lambda: sum(metric_sum(n.url, 'lmdeploy_num_idle_sessions') for n in nodes) == 0, 10, 'the session ended')


def test_client_gone_cancels_the_nodes_request(cluster):
    proxy, _, nodes = cluster
    long = dict(model=MODEL, messages=QUESTION, max_tokens=900, temperature=0, ignore_eos=True)  # minutes on cpu
    _wait(lambda: in_flight(nodes) == 0, 10, 'the nodes idle')
    with httpx.stream('POST', proxy + '/v1/chat/completions', json=dict(long, stream=True), headers=AUTH,
                      timeout=120) as r:
        lines = r.iter_lines()  # kept: a generator that is collected closes the connection
        next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
        assert in_flight(nodes) == 1
    # the stream closed after its first chunk: the proxy closes its connection to the node, which stops
    _wait(lambda: in_flight(nodes) == 0, 10, 'the stream stopped on its node')
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up waiting
        httpx.post(proxy + '/v1/chat/completions', json=long, headers=AUTH, timeout=1.5)
    _wait(lambda: in_flight(nodes) == 0, 10, 'the request stopped on its node')
    # a node stops counting the request in flight before its engine process takes the cancel off its queue
    _wait(lambda: all(metric_sum(n.url, 'lmdeploy_num_requests_running') == 0 for n in nodes), 10,
          'the engines stopped the request')


def test_unknown_model_is_a_404(cluster):
    proxy, _, _ = cluster
    r = httpx.post(proxy + '/v1/chat/completions', json=dict(model='nope', messages=QUESTION), headers=AUTH)
    assert r.status_code == 404
    assert r.json()['error']['code'] == 'model_not_found' and r.json()['error']['param'] == 'model'


def test_refused_connection_is_retried_on_another_node(cluster):
    """A proxy of its own (in this process, no health check during the test) in front of a dead URL,
    registered as the fastest node, and a real node: the request goes to the dead one first."""
    from fastapi.testclient import TestClient

    from lmdeploy.serve.proxy.app import create_app
    _, _, nodes = cluster
    dead = f'http://127.0.0.1:{_free_port()}'  # nothing listens there
    app = create_app(strategy='min_expected_latency', health_interval=3600)
    with TestClient(app, client=('127.0.0.1', 50000)) as c:  # no keys: the node table is edited from this machine
        assert c.post('/nodes/add', json={'url': dead, 'models': [MODEL], 'speed': 1e6}).status_code == 200
        real = c.post('/nodes/add', json={'url': nodes[0].url, 'speed': 1}).json()['node']
        assert real['models'] == [MODEL]  # not given: asked of the node
        before = metric_sum(nodes[0].url, 'lmdeploy_requests_total')
        r = c.post('/v1/chat/completions', json=dict(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0))
        assert r.status_code == 200 and r.headers['x-lmdeploy-node'] == nodes[0].url
        assert r.json()['choices'][0]['message']['content']
        assert metric_sum(nodes[0].url, 'lmdeploy_requests_total') - before == 1
        st = c.get('/nodes/status').json()
        assert st['retried_requests'] == 1
        by_url = {n['url']: n for n in st['nodes']}
        assert by_url[dead]['state'] == 'unreachable' and by_url[dead]['connect_failures'] == 1
        assert by_url[dead]['failed_checks'] == 0  # a failed request is no failed health check
        assert by_url[dead]['failed'] == 0 and by_url[dead]['unfinished'] == 0
        assert by_url[nodes[0].url]['finished'] == 1
        # with the only other node gone too, the proxy's own error, OpenAI-shaped
        assert c.post('/nodes/remove', json={'url': nodes[0].url}).status_code == 200
        r = c.post('/v1/chat/completions', json=dict(model=MODEL, messages=QUESTION, max_tokens=4))
        assert r.status_code == 503 and r.json()['error']['code'] == 'no_available_node', r.text


# ------------------------------------------------------------------------------------------- failures
def test_paused_node_is_dropped_then_taken_back(cluster):
    """kill -STOP for a few seconds: the node is dropped after --drop-after failed checks (2 of 1 s), and
    once it runs again (kill -CONT) the health check, which kept probing it, gives it traffic again."""
    proxy, proxy_proc, nodes = cluster
    paused, other = nodes
    os.killpg(paused.p.pid, signal.SIGSTOP)
    try:
        _wait(lambda: status(proxy)[paused.url]['state'] == 'dropped', 20, 'the paused node dropped')
        before = metric_sum(other.url, 'lmdeploy_requests_total')
        r = chat(proxy)  # meanwhile the other node serves
        assert r.status_code == 200 and r.headers['x-lmdeploy-node'] == other.url
        assert metric_sum(other.url, 'lmdeploy_requests_total') - before == 1
    finally:
        os.killpg(paused.p.pid, signal.SIGCONT)
    st = _wait(lambda: (lambda s: s if s[paused.url]['state'] == 'healthy' else None)(status(proxy)), 20,
               'the node taken back')
    assert st[paused.url]['failed_checks'] == 0 and st[other.url]['healthy']
    _wait(lambda: f'node {paused.url} is back' in proxy_proc.output, 5, 'the return logged')
    before = metric_sum(paused.url, 'lmdeploy_requests_total')
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: chat(proxy), range(4)))
    assert [r.status_code for r in answers] == [200] * 4
    assert metric_sum(paused.url, 'lmdeploy_requests_total') - before >= 1  # it gets requests again


def test_killed_node_loses_no_request_that_had_not_started(cluster):
    proxy, proxy_proc, nodes = cluster
    body = dict(model=MODEL, messages=QUESTION, max_tokens=400, temperature=0, ignore_eos=True, stream=True)
    with httpx.stream('POST', proxy + '/v1/chat/completions', json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        head = []  # up to the first chunk with text (the role chunk before it may come alone)
        for line in lines:
            head.append(line)
            if read_stream(head[-1:])[0]:
                break
        victim = next(n for n in nodes if n.url == r.headers['x-lmdeploy-node'])
        survivor = next(n for n in nodes if n is not victim)
        victim.kill()  # mid-stream
        before = metric_sum(survivor.url, 'lmdeploy_requests_total')
        with ThreadPoolExecutor(6) as pool:  # sent at once: some are sent to the dead node first
            answers = list(pool.map(lambda _: chat(proxy), range(6)))
        text, roles, errors, done = read_stream([*head, *lines])
    # the broken stream was not replayed: it ends with the proxy's error (a server error, then [DONE], as the
    # api_server ends its own), no second start
    assert done and roles == 1 and len(errors) == 1 and errors[0]['code'] == 'node_failed', (text, errors)
    assert errors[0]['type'] == 'internal_server_error'
    assert len(text) > 0
    # the requests sent after the kill all succeeded, on the survivor, once each
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    assert {r.headers['x-lmdeploy-node'] for r in answers} == {survivor.url}
    assert metric_sum(survivor.url, 'lmdeploy_requests_total') - before == 6
    # dropped after 2 failed health checks (the failed requests do not count), and kept: it is still probed
    st = _wait(lambda: (lambda s: s if s[victim.url]['state'] == 'dropped' else None)(status(proxy)), 15,
               'the killed node dropped')
    assert st[survivor.url]['healthy'] and st[victim.url]['failed_checks'] >= 2
    _wait(lambda: f'node {victim.url} is dropped' in proxy_proc.output, 5, 'the drop logged')


def test_graceful_shutdown_deregisters(cluster):
    proxy, proxy_proc, nodes = cluster
    node = next(n for n in nodes if n.p.poll() is None)
    dead = [n.url for n in nodes if n is not node]
    assert node.url in status(proxy)
    node.p.send_signal(signal.SIGTERM)
    assert node.p.wait(60) == 0
    # gone at once, by its own deregistration (the health check would need 2 failed rounds of 1 s)
    assert node.url not in status(proxy)
    _wait(lambda: f'node removed on request: {node.url}' in proxy_proc.output, 5, 'the removal logged')
    r = chat(proxy)
    assert r.status_code == 503
    err = r.json()['error']
    assert err['code'] == 'no_available_node' and err['type'] == 'service_unavailable_error'
    assert httpx.get(proxy + '/health').status_code == 503
    with open(proxy_proc.state_file) as f:  # the killed node's address is kept, as dropped
        assert [(e['url'], e['dropped']) for e in json.load(f)['nodes']] == [(u, True) for u in dead]
    proxy_proc.p.send_signal(signal.SIGTERM)
    assert proxy_proc.p.wait(30) == 0
