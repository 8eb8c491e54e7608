"""The proxy's parts without a model: the strategies, the node table and the health check's counting
(pure Python), the flags, and forwarding between small fake nodes (a node answering 503 is skipped, a
stream breaking mid-way is ended with an error and not replayed, requests wait in the proxy for a node
with room and are turned away with 429 / 503 beyond its bounds, a paused node comes back)."""

import asyncio
import json
import math
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmdeploy.serve.proxy.forward import DEFAULT_SLOTS, Admission, Forwarder
from lmdeploy.serve.proxy.health import HealthChecker
from lmdeploy.serve.proxy.nodes import WINDOW, Node, NodeTable, normalize_url
from lmdeploy.serve.proxy.strategies import STRATEGIES, choose


def _nodes(rng, n, speeds=True, latencies=False):
    out = []
    for i in range(n):
        node = Node(f'http://10.0.0.{i}:23333', given_speed=rng.uniform(0.5, 20) if speeds else None)
        node.unfinished = rng.randrange(0, 9)
        if latencies:
            for _ in range(rng.randrange(1, 5)):
                node.finish(rng.uniform(0.1, 5), rng.randrange(1, 4))
            node.unfinished = rng.randrange(0, 9)
        out.append(node)
    return out


# ------------------------------------------------------------------------------------- strategies
def test_random_is_weighted_by_speed():
    rng = random.Random()
    nodes = _nodes(rng, 4)
    draws = 20000
    counts = {n.url: 0 for n in nodes}
    for _ in range(draws):
        counts[choose('random', nodes, rng).url] += 1
    total = sum(n.speed() for n in nodes)
    for n in nodes:
        p = n.speed() / total
        sigma = math.sqrt(draws * p * (1 - p))
        assert abs(counts[n.url] - draws * p) < 5 * sigma + 1, (counts, [x.speed() for x in nodes])


def test_min_expected_latency_is_the_shortest_queue_for_its_speed():
    rng = random.Random()
    for _ in range(200):
        nodes = _nodes(rng, rng.randrange(1, 7))
        best = min((n.unfinished + 1) / n.speed() for n in nodes)
        chosen = choose('min_expected_latency', nodes, rng)
        assert math.isclose((chosen.unfinished + 1) / chosen.speed(), best)


def test_unmeasured_nodes_get_the_mean_speed():
    rng = random.Random()
    known = _nodes(rng, 3)
    new = Node('http://10.0.0.9:1')
    mean = sum(n.speed() for n in known) / 3
    new.unfinished = 0
    for n in known:
        n.unfinished = 0
    chosen = choose('min_expected_latency', [*known, new], rng)
    fastest = max(known, key=lambda n: n.speed())
    assert chosen is (fastest if fastest.speed() > mean else new)
    # nothing measured anywhere: all equal, so the queue decides
    fresh = [Node(f'http://h{i}:1') for i in range(4)]
    for i, n in enumerate(fresh):
        n.unfinished = (i + 2) % 4
    assert choose('min_expected_latency', fresh, rng) is fresh[2]


def test_ties_are_broken_at_random():
    rng = random.Random()
    nodes = [Node(f'http://h{i}:1', given_speed=3.0) for i in range(3)]
    seen = {choose(s, nodes, rng).url for s in STRATEGIES for _ in range(100)}
    assert seen == {n.url for n in nodes}


def test_min_observed_latency():
    rng = random.Random()
    for _ in range(200):
        nodes = _nodes(rng, rng.randrange(1, 7), latencies=True)
        chosen = choose('min_observed_latency', nodes, rng)
        assert math.isclose(chosen.observed_latency(), min(n.observed_latency() for n in nodes))
    # a node not measured yet counts as the best seen, and the queue breaks the tie
    nodes = _nodes(rng, 3, latencies=True)
    new = Node('http://new:1')
    best = min(nodes, key=lambda n: n.observed_latency())
    new.unfinished, best.unfinished = 0, 5
    assert choose('min_observed_latency', [*nodes, new], rng) is new
    new.unfinished = 6
    assert choose('min_observed_latency', [*nodes, new], rng) is best


def test_bad_strategy_and_no_nodes():
    with pytest.raises(ValueError, match='unknown strategy'):
        choose('fastest', [Node('http://a:1')])
    with pytest.raises(ValueError, match='no node'):
        choose('random', [])


# ------------------------------------------------------------------------------------- the table
def test_speed_is_littles_law_over_the_window():
    rng = random.Random()
    node = Node('http://a:1', given_speed=7.0)
    assert node.speed() == 7.0 and node.observed_latency() is None
    samples = [(rng.uniform(0.05, 3), rng.randrange(1, 9)) for _ in range(WINDOW + 10)]
    for s, c in samples:
        node.start()
        node.finish(s, c)
    last = samples[-WINDOW:]
    assert math.isclose(node.speed(), sum(c for _, c in last) / sum(s for s, _ in last))
    assert math.isclose(node.observed_latency(), sum(s for s, _ in last) / WINDOW)
    assert node.unfinished == 0 and node.finished == len(samples)
    node.start()
    node.fail()
    node.start()
    node.drop()
    assert (node.unfinished, node.failed, node.finished) == (0, 1, len(samples))


def test_table_add_again_keeps_measurements_and_state(tmp_path):
    table = NodeTable()
    a = table.add('http://10.0.0.1:23333/', ['m1'])
    assert a.url == 'http://10.0.0.1:23333' and table.candidates('m1') == [a] and table.candidates('m2') == []
    a.start()
    a.finish(0.5)
    table.set_state(a, 'unreachable')
    a.failed_checks = 2
    # a node registering again keeps what was measured, and its state: the proxy asks its /health itself
    again = table.add('http://10.0.0.1:23333', None, max_batch_size=8)
    assert again is a and a.state == 'unreachable' and a.failed_checks == 2 and a.finished == 1
    assert a.models == ['m1'] and a.max_batch_size == 8 and table.candidates('m1') == []
    assert table.set_state(a, 'healthy') and not table.set_state(a, 'healthy') and table.candidates('m1') == [a]
    anyone = table.add('http://10.0.0.2:1')  # models unknown: gets every model
    assert table.candidates('m2') == [anyone] and table.model_names() == ['m1']
    assert table.remove('http://10.0.0.2:1/') and not table.remove('http://10.0.0.2:1')
    for bad in ('', '10.0.0.1:80', 'ftp://h', 'http://', 'http://h:99999', 'http://h:1?x=1'):
        with pytest.raises(ValueError):
            normalize_url(bad)
    with pytest.raises(ValueError, match='speed'):
        table.add('http://h:1', speed=0)
    with pytest.raises(ValueError, match='max_batch_size'):
        table.add('http://h:1', max_batch_size=0)


def test_table_file_survives_a_restart(tmp_path):
    path = str(tmp_path / 'nodes.json')
    table = NodeTable(path)
    table.add('http://10.0.0.1:1', ['m'], speed=3.0, max_batch_size=16)
    table.add('http://10.0.0.2:1')
    table.remove('http://10.0.0.2:1')
    table.set_state(table.add('http://10.0.0.3:1', ['x', 'y']), 'dropped')  # kept, and still probed
    again = NodeTable(path)
    assert {u: (n.models, n.given_speed, n.max_batch_size, n.state) for u, n in again.nodes.items()} == {
        'http://10.0.0.1:1': (['m'], 3.0, 16, 'healthy'), 'http://10.0.0.3:1': (['x', 'y'], None, None, 'dropped')}
    assert again.nodes['http://10.0.0.3:1'].dropped_at is not None
    (tmp_path / 'broken.json').write_text('{"nodes": 3')
    with pytest.raises(ValueError, match='cannot read'):
        NodeTable(str(tmp_path / 'broken.json'))


# ------------------------------------------------------------------------------------- the flags
def test_cli_flags():
    from lmdeploy.cli import build_parser
    from lmdeploy.cli.serve import build_serve_kwargs
    parser = build_parser()
    args = parser.parse_args(['serve', 'proxy', '--server-port', '8001', '--strategy', 'random', '--api-keys', 'k'])
    assert (args.server_port, args.strategy, args.api_keys) == (8001, 'random', ['k'])
    assert (args.node_slots, args.node_queue, args.max_queue, args.queue_timeout, args.forget_after) == (
        None, None, None, 60.0, 3600.0)
    args = parser.parse_args(['serve', 'proxy', '--node-slots', '10', '--node-queue', '3', '--max-queue', '0',
                              '--queue-timeout', '5', '--forget-after', '0'])
    assert (args.node_slots, args.node_queue, args.max_queue, args.queue_timeout, args.forget_after) == (
        10, 3, 0, 5.0, 0.0)
    from lmdeploy.cli.proxy import run_proxy
    for bad, match in ((['--node-slots', '0'], 'node-slots'), (['--max-queue', '-1'], 'max-queue'),
                       (['--queue-timeout', '-1'], 'queue-timeout'), (['--forget-after', '-5'], 'forget-after')):
        with pytest.raises(ValueError, match=match):
            run_proxy(parser.parse_args(['serve', 'proxy', *bad]))
    helptext = parser._subparsers._group_actions[0].choices['serve']._subparsers._group_actions[0].choices[
        'proxy'].format_help()
    helptext = ' '.join(helptext.split())
    assert 'only be added or removed from this machine' in helptext and '429' in helptext
    with pytest.raises(SystemExit):
        parser.parse_args(['serve', 'proxy', '--strategy', 'fastest'])
    args = parser.parse_args(['serve', 'api_server', '--proxy-url', 'http://h:8000', '--proxy-api-key', 'k'])
    kw = build_serve_kwargs(args)
    assert (kw['proxy_url'], kw['proxy_api_key'], kw['node_url']) == ('http://h:8000', 'k', None)
    assert 'proxy_url' not in build_serve_kwargs(parser.parse_args(['serve', 'api_server']))
    with pytest.raises(ValueError, match='proxy-url'):
        build_serve_kwargs(parser.parse_args(['serve', 'api_server', '--proxy-url', 'h:8000']))


def test_own_url():
    from lmdeploy.serve.proxy.register import own_url
    assert own_url('127.0.0.1', 5, 'http://127.0.0.1:8000') == 'http://127.0.0.1:5'
    assert own_url('0.0.0.0', 5, 'http://127.0.0.1:8000') == 'http://127.0.0.1:5'  # the way to the proxy
    assert own_url('::1', 5, 'http://[::1]:8000', 'https') == 'https://[::1]:5'


# ------------------------------------------------------------------------------ fake nodes, forwarding
def _fake_node(mode: str):
    """A node without a model: 'busy' answers 503 like a draining api_server; 'ok' answers JSON and
    streams 3 events; 'breaks' streams 2 events then drops the connection."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    app = FastAPI()
    app.state.calls = 0

    @app.get('/health')
    async def health():
        return {'status': 'ok'}

    @app.post('/v1/chat/completions')
    async def chat(request: Request):
        app.state.calls += 1
        body = await request.json()
        if mode == 'busy':
            return JSONResponse({'error': {'message': 'the server is shutting down', 'code': 'shutting_down'}}, 503)
        if not body.get('stream'):
            return {'echo': body['messages'], 'node': mode}

        async def events():
            for i in range(3):
                if mode == 'breaks' and i == 2:
                    raise RuntimeError('node died')  # uvicorn drops the connection mid-body
                yield f'data: {json.dumps({"i": i})}\n\n'
                await asyncio.sleep(0.05)
            yield 'data: [DONE]\n\n'

        return StreamingResponse(events(), media_type='text/event-stream')

    return app


@pytest.fixture(scope='module')
def fake_nodes():
    pytest.importorskip('fastapi')
    from lmdeploy.serve.openai.uvicorn_server import BackgroundServer
    servers = {mode: BackgroundServer(_fake_node(mode), log_level='critical').start()
               for mode in ('busy', 'ok', 'breaks')}
    yield servers
    for s in servers.values():
        s.stop(5)


def test_503_node_is_skipped_and_broken_stream_is_not_replayed(fake_nodes):
    from fastapi.testclient import TestClient

    from lmdeploy.serve.proxy.app import create_app
    busy, ok, breaks = (fake_nodes[m] for m in ('busy', 'ok', 'breaks'))
    app = create_app(strategy='min_expected_latency', health_interval=3600, api_keys=['k'])
    with TestClient(app, headers={'Authorization': 'Bearer k'}) as c:
        c.post('/nodes/add', json={'url': busy.url, 'models': ['m'], 'speed': 100})
        c.post('/nodes/add', json={'url': ok.url, 'models': ['m'], 'speed': 1})
        msg = [{'role': 'user', 'content': f'hi {random.random()}'}]
        r = c.post('/v1/chat/completions', json={'model': 'm', 'messages': msg})
        assert r.status_code == 200 and r.json() == {'echo': msg, 'node': 'ok'}
        assert busy.app.state.calls == 1 and ok.app.state.calls == 1
        st = {n['url']: n for n in c.get('/nodes/status').json()['nodes']}
        assert st[busy.url]['state'] == 'not_ready'  # until a health check says otherwise
        assert c.post('/nodes/remove', json={'url': ok.url}).status_code == 200
        r = c.post('/v1/chat/completions', json={'model': 'm', 'messages': msg})
        assert r.status_code == 503 and r.json()['error']['code'] == 'no_available_node'
        c.post('/nodes/add', json={'url': breaks.url, 'models': ['m']})
        with c.stream('POST', '/v1/chat/completions', json={'model': 'm', 'messages': msg, 'stream': True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith('data: ')]
        assert [json.loads(e) for e in events[:2]] == [{'i': 0}, {'i': 1}]
        # ended as the api_server ends its own mid-stream errors: a server error, then [DONE]
        assert len(events) == 4 and events[3] == '[DONE]', events
        err = json.loads(events[2])['error']
        assert err['code'] == 'node_failed' and err['type'] == 'internal_server_error'
        assert breaks.app.state.calls == 1  # not replayed
        st = {n['url']: n for n in c.get('/nodes/status').json()['nodes']}
        assert st[breaks.url]['failed'] == 1 and st[breaks.url]['state'] == 'unreachable'
        # a request's failure counts apart from the health checks: it takes a node out of rotation only
        assert st[breaks.url]['connect_failures'] == 1 and st[breaks.url]['failed_checks'] == 0


# ------------------------------------------------------------------------ an api_server's registration
class _ProxyThread:
    """The proxy app on uvicorn in a thread, with its lifespan (its HTTP client and health check)."""

    def __init__(self, app):
        import threading

        import uvicorn
        self.server = uvicorn.Server(uvicorn.Config(app, host='127.0.0.1', port=0, log_level='critical'))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        import time
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), 'the proxy did not start'
            time.sleep(0.02)
        self.url = f'http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}'

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def test_registration_with_and_without_the_key(caplog, monkeypatch):
    import httpx

    from lmdeploy.serve.proxy.app import create_app
    from lmdeploy.serve.proxy.register import ENV_KEY, ProxyLink
    key = f'sk-{random.getrandbits(64):x}'
    table_app = create_app(api_keys=[key], health_interval=3600)
    proxy = _ProxyThread(table_app)
    try:
        node = 'http://10.1.2.3:23333'
        listed = lambda: [n['url'] for n in httpx.get(proxy.url + '/nodes/status',  # noqa: E731
                                                    headers={'Authorization': f'Bearer {key}'}).json()['nodes']]
        caplog.set_level('WARNING', logger='lmdeploy')
        monkeypatch.delenv(ENV_KEY, raising=False)
        assert not ProxyLink(proxy.url, node, ['m']).register(attempts=3, delay=0.01)  # no key: refused at once
        assert not ProxyLink(proxy.url, node, ['m'], api_key='wrong').register(attempts=3, delay=0.01)
        assert listed() == []
        assert 'could not register with the proxy' in caplog.text and 'HTTP 401' in caplog.text
        monkeypatch.setenv(ENV_KEY, key)  # the key from the environment
        link = ProxyLink(proxy.url, node, ['m'])
        assert link.register() and listed() == [node]
        assert link.deregister() and listed() == []
        assert not link.deregister()  # once
        # a proxy that is not there: a warning after the attempts, nothing raised
        caplog.clear()
        gone = ProxyLink('http://127.0.0.1:9', node, ['m'], api_key=key, timeout=1)
        assert not gone.register(attempts=2, delay=0.01)
        assert 'could not register' in caplog.text and 'ConnectError' in caplog.text
        with pytest.raises(ValueError, match='proxy-url'):
            ProxyLink('127.0.0.1:8000', node)
    finally:
        proxy.stop()


# ------------------------------------------------------------------------------------- health checks
class _ScriptedChecker(HealthChecker):
    """Health checks answered from a dict (url -> state) instead of the network."""

    def __init__(self, table, answers, **kw):
        super().__init__(table, None, **kw)
        self.answers = answers

    async def check(self, node, timeout=None):
        return self.answers[node.url]


def test_failed_requests_do_not_drop_a_node_and_a_dropped_node_comes_back():
    table = NodeTable()
    node = table.add('http://10.0.0.1:1')
    answers = {node.url: 'unreachable'}
    checker = _ScriptedChecker(table, answers, interval=1, drop_after=3, forget_after=0)
    fw = Forwarder(table, 'min_expected_latency', None)
    for _ in range(61):  # a burst of requests that found it down (the 61)
        fw._mark_down(node, 'unreachable', 'ConnectError')
    assert node.state == 'unreachable' and node.connect_failures == 61 and node.failed_checks == 0
    asyncio.run(checker.check_all())
    assert node.state == 'unreachable' and node.failed_checks == 1  # one failed check is not three
    asyncio.run(checker.check_all())
    asyncio.run(checker.check_all())
    assert node.state == 'dropped' and node.dropped_at is not None and table.get(node.url) is node
    for _ in range(10):  # still probed; with forget_after=0 never forgotten
        asyncio.run(checker.check_all())
    assert node.state == 'dropped' and table.candidates(None) == []
    answers[node.url] = 'healthy'  # it answers /health again (kill -CONT)
    asyncio.run(checker.check_all())
    assert node.healthy and node.failed_checks == 0 and node.dropped_at is None and table.candidates(None) == [node]
    # a check with any answer in between starts the count again
    for state in ('unreachable', 'unreachable', 'not_ready', 'unreachable', 'unreachable'):
        answers[node.url] = state
        asyncio.run(checker.check_all())
    assert node.state == 'unreachable' and node.failed_checks == 2


def test_a_dropped_node_is_forgotten_after_forget_after():
    table = NodeTable()
    node = table.add('http://10.0.0.1:1')
    checker = _ScriptedChecker(table, {node.url: 'unreachable'}, interval=1, drop_after=1, forget_after=30)
    asyncio.run(checker.check_all())
    assert node.state == 'dropped'
    asyncio.run(checker.check_all())
    assert table.get(node.url) is node
    node.dropped_at -= 31
    asyncio.run(checker.check_all())
    assert table.get(node.url) is None
    with pytest.raises(ValueError, match='forget_after'):
        HealthChecker(table, None, forget_after=-1)


def test_admission_defaults_and_bounds():
    adm = Admission()
    n = Node('http://a:1')
    assert (adm.slots(n), adm.unstarted(n), adm.queue(n)) == (DEFAULT_SLOTS, DEFAULT_SLOTS // 4, DEFAULT_SLOTS)
    n.max_batch_size = 8  # as an api_server registers: its batch plus an eighth, at least 2
    assert (adm.slots(n), adm.unstarted(n), adm.queue(n)) == (10, 4, 10)
    n.max_batch_size = 256
    assert (adm.slots(n), adm.unstarted(n), adm.queue(n)) == (288, 72, 288)
    adm = Admission(node_slots=3, node_queue=1, max_queue=0)
    assert (adm.slots(n), adm.unstarted(n), adm.queue(n)) == (3, 1, 0)
    n.unfinished = 2
    assert adm.has_room(n)
    n.unstarted = 1  # a stream it has not begun answering: its engine's queue is full
    assert not adm.has_room(n)
    n.unstarted, n.unfinished = 0, 3
    assert not adm.has_room(n)
    for bad in (dict(node_slots=0), dict(node_queue=0), dict(max_queue=-1), dict(queue_timeout=0)):
        with pytest.raises(ValueError):
            Admission(**bad)


# ------------------------------------------------------------------------------ the proxy on uvicorn
def _start_proxy(**kw):
    from lmdeploy.serve.proxy.app import create_app
    return _ProxyThread(create_app(**kw))


def _add(proxy, url, **node):
    import httpx
    r = httpx.post(proxy.url + '/nodes/add', json={'url': url, 'models': ['m'], **node}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()['node']


def _status(proxy):
    import httpx
    return httpx.get(proxy.url + '/nodes/status', timeout=10).json()


def _until(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_every_header_once(fake_nodes):
    """uvicorn writes the proxy's own date and server headers: a node's are not passed on as well."""
    import httpx
    ok = fake_nodes['ok']
    proxy = _start_proxy(health_interval=3600)
    try:
        _add(proxy, ok.url)
        msg = [{'role': 'user', 'content': 'hi'}]
        r = httpx.post(proxy.url + '/v1/chat/completions', json={'model': 'm', 'messages': msg}, timeout=10)
        with httpx.stream('POST', proxy.url + '/v1/chat/completions', timeout=10,
                          json={'model': 'm', 'messages': msg, 'stream': True}) as s:
            lines = list(s.iter_lines())
        for answer in (r, s):
            assert answer.status_code == 200
            for name in ('date', 'server', 'content-type', 'x-lmdeploy-node'):
                assert len(answer.headers.get_list(name)) == 1, (name, answer.headers)
        assert lines[-2:] == ['data: [DONE]', '']
    finally:
        proxy.stop()


def _batch_node(name: str, batch: int, seconds: float):
    """A node that runs ``batch`` requests at once, each for ``seconds`` (or the body's ``seconds``), and
    queues the rest, as an engine does; a stream's headers come once it runs (the api_server sends them with
    its first token). It counts what it served, and the most requests it held at once (running and queued);
    while ``app.state.paused`` its /health does not answer."""
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse
    app = FastAPI()
    st = app.state
    st.served, st.inside, st.most_inside, st.running, st.most_running, st.paused = 0, 0, 0, 0, 0, False
    sem = []

    @app.get('/health')
    async def health():
        while st.paused:
            await asyncio.sleep(0.02)
        return {'status': 'ok'}

    async def run(body):
        if not sem:
            sem.append(asyncio.Semaphore(batch))
        st.inside += 1
        st.most_inside = max(st.most_inside, st.inside)
        await sem[0].acquire()
        st.running += 1
        st.most_running = max(st.most_running, st.running)
        return body.get('seconds', seconds)

    def done():
        st.running -= 1
        st.inside -= 1
        st.served += 1
        sem[0].release()

    async def handle(request: Request):
        body = await request.json()
        took = await run(body)
        if not body.get('stream'):
            try:
                await asyncio.sleep(took)
            finally:
                done()
            return {'node': name, 'end': time.monotonic()}

        async def events():
            try:
                for i in range(4):
                    yield f'data: {json.dumps({"i": i, "node": name})}\n\n'
                    await asyncio.sleep(took / 4)
                yield 'data: [DONE]\n\n'
            finally:
                done()

        return StreamingResponse(events(), media_type='text/event-stream')

    app.add_api_route('/v1/chat/completions', handle, methods=['POST'])
    app.add_api_route('/generate', handle, methods=['POST'])
    return app


@pytest.fixture
def batch_nodes():
    pytest.importorskip('fastapi')
    from lmdeploy.serve.openai.uvicorn_server import BackgroundServer
    servers = [BackgroundServer(_batch_node(name, 4, 0.2), log_level='critical').start() for name in 'ab']
    yield servers
    for s in servers:
        s.stop(5)


@pytest.mark.parametrize('stream', [False, True])
def test_requests_wait_in_the_proxy_and_go_to_the_first_node_with_room(batch_nodes, stream):
    """Two nodes alike, but the proxy was told one is 100x faster: by speed alone it would be handed every
    request up front. Each node holds a bounded number, the rest wait in the proxy and go to whichever node
    finishes one: an even split, and neither node idles at the end. Streamed: the nodes register a batch of
    64 (72 slots) but run 4 at once (a KV cache that runs out first); the streams they have not begun
    answering (at most 18) bound them."""
    import httpx
    a, b = batch_nodes
    proxy = _start_proxy(health_interval=3600, max_queue=1000)
    try:
        batch = 64 if stream else 4
        _add(proxy, a.url, speed=100, max_batch_size=batch)
        _add(proxy, b.url, speed=1, max_batch_size=batch)
        count = 96 if stream else 48
        client = httpx.Client(base_url=proxy.url, timeout=60, limits=httpx.Limits(max_connections=count))

        def one(_):
            body = {'model': 'm', 'messages': [], 'stream': stream}
            if not stream:
                r = client.post('/v1/chat/completions', json=body)
                return r.status_code, r.json()['node'], time.monotonic() - t0
            with client.stream('POST', '/v1/chat/completions', json=body) as r:
                events = [line for line in r.iter_lines() if line.startswith('data: ')]
            assert events[-1] == 'data: [DONE]' and len(events) == 5
            return r.status_code, json.loads(events[0][6:])['node'], time.monotonic() - t0

        with client, ThreadPoolExecutor(count) as pool:
            t0 = time.monotonic()
            answers = list(pool.map(one, range(count)))
        assert [s for s, _, _ in answers] == [200] * count
        split = Counter(n for _, n, _ in answers)
        ends = {n: max((t for _, m, t in answers if m == n), default=0.0) for n in 'ab'}
        run = max(ends.values())
        idle = abs(ends['a'] - ends['b']) / run
        print(f'stream={stream}: split {dict(split)}, run {run:.2f} s, idle tail {idle:.0%}')
        assert min(split['a'], split['b']) >= count // 3, split
        assert idle < 0.25, (ends, split)
        for node in (a, b):
            held = node.app.state.most_inside
            # non-streamed: at most its slots (4 + 2); streamed: 4 running + at most 18 it had not begun
            assert held <= (22 if stream else 6), held
            assert node.app.state.most_running == 4
        st = _status(proxy)
        assert st['queued_requests'] == 0 and st['rejected_requests'] == 0
        assert all(n['unfinished'] == 0 and n['unstarted'] == 0 for n in st['nodes'])
    finally:
        proxy.stop()


def test_overload_is_turned_away_with_retry_after():
    """One node that runs one request at a time: the proxy keeps 1 there (--node-slots 1), lets 1 wait
    (--max-queue 1) for at most 0.5 s (--queue-timeout): the next is a 429, the waiting one a 503."""
    import httpx

    from lmdeploy.serve.openai.uvicorn_server import BackgroundServer
    node = BackgroundServer(_batch_node('slow', 1, 1.5), log_level='critical').start()
    proxy = _start_proxy(health_interval=3600, node_slots=1, max_queue=1, queue_timeout=0.5)
    try:
        _add(proxy, node.url)
        post = lambda timeout=30, **kw: httpx.post(proxy.url + '/v1/chat/completions',  # noqa: E731
                                                   json={'model': 'm', 'messages': [], **kw}, timeout=timeout)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post)
            _until(lambda: node.app.state.inside == 1, 5, 'the first request at the node')
            waits = pool.submit(post)
            _until(lambda: _status(proxy)['queued_requests'] == 1, 5, 'the second request waiting')
            t = time.monotonic()
            full = post()
            assert time.monotonic() - t < 0.4  # at once, not after waiting
            assert full.status_code == 429, full.text
            err = full.json()['error']
            assert err['code'] == 'queue_full' and err['type'] == 'rate_limit_error'
            assert int(full.headers['retry-after']) >= 1
            late = waits.result()
            assert late.status_code == 503 and late.json()['error']['code'] == 'queue_timeout', late.text
            assert int(late.headers['retry-after']) >= 1
            assert first.result().status_code == 200
        st = _status(proxy)
        assert (st['rejected_requests'], st['timed_out_requests'], st['queued_requests']) == (1, 1, 0)
        assert node.app.state.served == 1  # neither of the others reached the node
        # a client that gives up while its request waits in the proxy: it leaves the queue, never reaches
        # the node, and the next request gets the node when it is free
        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(post, seconds=0.6)
            _until(lambda: node.app.state.inside == 1, 5, 'a request at the node')
            with pytest.raises(httpx.ReadTimeout):
                post(timeout=0.2)
            _until(lambda: _status(proxy)['queued_requests'] == 0, 5, 'the request gone from the queue')
            assert busy.result().status_code == 200
        assert post(seconds=0).status_code == 200
        assert node.app.state.served == 3
        # no healthy node: a 503 that says when to look again
        httpx.post(proxy.url + '/nodes/remove', json={'url': node.url})
        r = post()
        assert r.status_code == 503 and r.json()['error']['code'] == 'no_available_node'
        assert r.headers['retry-after'] == '60'  # the health check's interval (3600 s), at most a minute
        assert httpx.get(proxy.url + '/health').headers['retry-after'] == '60'
    finally:
        proxy.stop()
        node.stop(5)


def test_a_session_waits_for_its_node(batch_nodes):
    import httpx
    a, b = batch_nodes
    proxy = _start_proxy(health_interval=3600, node_slots=1)
    try:
        _add(proxy, a.url)
        _add(proxy, b.url)
        gen = lambda **kw: httpx.post(proxy.url + '/generate', json={'prompt': 'x', **kw}, timeout=30)  # noqa
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(gen, session_id=7, seconds=0.6)
            _until(lambda: a.app.state.inside + b.app.state.inside == 1, 5, 'the first turn at a node')
            home, other = (a, b) if a.app.state.inside else (b, a)
            t = time.monotonic()
            second = pool.submit(gen, session_id=7, seconds=0)  # its node is full: it waits for it
            free = gen(seconds=0)  # the other node has room: no wait
            assert second.result().headers['x-lmdeploy-node'] == home.url
            assert time.monotonic() - t > 0.3
            assert first.result().headers['x-lmdeploy-node'] == home.url
            assert free.headers['x-lmdeploy-node'] == other.url
            # cancelling or ending the session does no work there: it goes at once, full node or not
            busy = pool.submit(gen, session_id=7, seconds=0.6)
            _until(lambda: home.app.state.inside == 1, 5, 'a turn at its node')
            for control in ({'cancel': True}, {'end_session': True}):
                t = time.monotonic()
                r = gen(session_id=7, seconds=0, **control)
                assert r.headers['x-lmdeploy-node'] == home.url and time.monotonic() - t < 0.4
            assert busy.result().status_code == 200
    finally:
        proxy.stop()


def test_a_paused_node_is_dropped_then_taken_back(batch_nodes):
    """kill -STOP, as the proxy sees it: /health stops answering. The node is dropped after --drop-after
    checks, still probed, and gets requests again once it answers."""
    import httpx
    a, b = batch_nodes
    proxy = _start_proxy(health_interval=0.2, drop_after=2)
    try:
        _add(proxy, a.url)
        _add(proxy, b.url)
        state = lambda: {n['url']: n['state'] for n in _status(proxy)['nodes']}  # noqa: E731
        a.app.state.paused = True
        _until(lambda: state()[a.url] == 'dropped', 5, 'the paused node dropped')
        served = a.app.state.served
        for _ in range(4):
            r = httpx.post(proxy.url + '/v1/chat/completions', json={'model': 'm', 'seconds': 0}, timeout=10)
            assert r.headers['x-lmdeploy-node'] == b.url
        assert a.app.state.served == served
        a.app.state.paused = False
        _until(lambda: state()[a.url] == 'healthy', 5, 'the node taken back')
        with ThreadPoolExecutor(8) as pool:
            nodes = set(pool.map(lambda _: httpx.post(proxy.url + '/v1/chat/completions', timeout=10, json={
                'model': 'm', 'seconds': 0.2}).headers['x-lmdeploy-node'], range(8)))
        assert nodes == {a.url, b.url}
    finally:
        a.app.state.paused = False
        proxy.stop()


def test_node_management_needs_a_key_or_this_machine():
    from fastapi.testclient import TestClient

    from lmdeploy.serve.proxy.app import create_app
    node = {'url': 'http://10.9.9.9:1', 'models': ['m']}
    app = create_app(health_interval=3600)
    with TestClient(app, client=('192.0.2.7', 5000)) as far:
        for path in ('/nodes/add', '/nodes/remove'):
            r = far.post(path, json=node)
            assert r.status_code == 403 and r.json()['error']['code'] == 'forbidden', r.text
            assert '--api-keys' in r.json()['error']['message']
        assert far.get('/v1/models').status_code == 200 and far.get('/nodes/status').json()['nodes'] == []
    for host in ('127.0.0.1', '::1'):
        with TestClient(app, client=(host, 5000)) as near:
            assert near.post('/nodes/add', json=node).status_code == 200
            assert near.post('/nodes/remove', json=node).status_code == 200
    keyed = create_app(health_interval=3600, api_keys=['k'])
    with TestClient(keyed, client=('192.0.2.7', 5000)) as far:
        assert far.post('/nodes/add', json=node).status_code == 401
        assert far.post('/nodes/add', json=node, headers={'Authorization': 'Bearer k'}).status_code == 200


def test_live_nodes_register_again(fake_nodes, caplog):
    """A node's heartbeat brings it back to a proxy that forgot it, and one registering again while the
    proxy has it down is asked at once; one removed by hand stays out until it registers afresh."""
    import httpx

    from lmdeploy.serve.proxy.register import ProxyLink
    ok = fake_nodes['ok']
    proxy = _start_proxy(health_interval=3600)
    table = proxy.server.config.app.state.table
    link = ProxyLink(proxy.url, ok.url, ['m'], max_batch_size=8, heartbeat=0.1)
    beats = threading.Thread(target=link.keep_registered, daemon=True)
    try:
        caplog.set_level('WARNING', logger='lmdeploy')
        assert link.register()
        listed = lambda: {n['url']: n for n in _status(proxy)['nodes']}  # noqa: E731
        entry = listed()[ok.url]
        assert entry['max_batch_size'] == 8 and entry['slots'] == 10 and entry['node_queue'] == 4
        beats.start()
        table.remove(ok.url, 'forgotten')  # as the health check forgets a node (or a proxy restarted)
        _until(lambda: ok.url in listed(), 5, 'the node back by its heartbeat')
        table.set_state(table.get(ok.url), 'dropped')
        _until(lambda: listed()[ok.url]['state'] == 'healthy', 5, 'the node asked at once when it registered')
        assert httpx.post(proxy.url + '/nodes/remove', json={'url': ok.url}).status_code == 200
        time.sleep(0.4)
        assert ok.url not in listed()  # its heartbeats are refused
        assert 'was removed on request' in caplog.text
        assert link.register() and ok.url in listed()  # a fresh registration (a restarted server)
        assert link.deregister() and ok.url not in listed()
        beats.join(2)
        assert not beats.is_alive()
        time.sleep(0.3)
        assert ok.url not in listed()
    finally:
        link.deregister()
        proxy.stop()
