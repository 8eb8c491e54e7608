"""The proxy's parts without a model: the strategies and the node table (pure Python), the flags, and
forwarding between small fake nodes (a node answering 503 is skipped, a stream breaking mid-way is
ended with an error and not replayed)."""

import asyncio
import json
import math
import random

import pytest

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


def test_table_add_again_keeps_measurements(tmp_path):
    table = NodeTable()
    a = table.add('http://10.0.0.1:23333/', ['m1'])
    assert a.url == 'http://10.0.0.1:23333' and table.candidates('m1') == [a] and table.candidates('m2') == []
    a.start()
    a.finish(0.5)
    a.state, a.failures = 'unreachable', 2
    again = table.add('http://10.0.0.1:23333', None)  # a restarted node registering again
    assert again is a and a.healthy and a.failures == 0 and a.finished == 1 and a.models == ['m1']
    anyone = table.add('http://10.0.0.2:1')  # models unknown: gets every model
    assert table.candidates('m2') == [anyone] and table.model_names() == ['m1']
    assert table.remove('http://10.0.0.2:1/') and not table.remove('http://10.0.0.2:1')
    for bad in ('', '10.0.0.1:80', 'ftp://h', 'http://', 'http://h:99999', 'http://h:1?x=1'):
        with pytest.raises(ValueError):
            normalize_url(bad)
    with pytest.raises(ValueError, match='speed'):
        table.add('http://h:1', speed=0)


def test_table_file_survives_a_restart(tmp_path):
    path = str(tmp_path / 'nodes.json')
    table = NodeTable(path)
    table.add('http://10.0.0.1:1', ['m'], speed=3.0)
    table.add('http://10.0.0.2:1')
    table.remove('http://10.0.0.2:1')
    table.add('http://10.0.0.3:1', ['x', 'y'])
    again = NodeTable(path)
    assert {u: (n.models, n.given_speed) for u, n in again.nodes.items()} == {
        'http://10.0.0.1:1': (['m'], 3.0), 'http://10.0.0.3:1': (['x', 'y'], None)}
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
        assert len(events) == 3 and json.loads(events[2])['error']['code'] == 'node_failed'
        assert breaks.app.state.calls == 1  # not replayed
        st = {n['url']: n for n in c.get('/nodes/status').json()['nodes']}
        assert st[breaks.url]['failed'] == 1 and st[breaks.url]['state'] == 'unreachable'


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
