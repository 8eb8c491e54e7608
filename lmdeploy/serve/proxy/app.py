"""The proxy's FastAPI app and :func:`serve` (``lmdeploy serve proxy``).

Routes:

* ``GET  /v1/models`` - the models of the registered nodes, each once
* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /generate`` (and any other
  ``POST /v1/...``) - forwarded to a node chosen by the strategy, once one has room (:mod:`.forward`);
  429 / 503 with ``Retry-After`` when the proxy's queue is full or a request waited too long
* ``GET  /nodes/status``, ``POST /nodes/add``, ``POST /nodes/remove`` - the node table
* ``GET  /health`` - 200 while some node is healthy, else 503

With ``api_keys`` every route but ``/health`` (and the docs) needs ``Authorization: Bearer KEY``:
clients' requests and the nodes' registrations alike. Without keys, ``/nodes/add`` and
``/nodes/remove`` are only taken from this machine (a loopback address): anyone who can reach the
proxy could otherwise point it at a server of theirs. The client's Authorization header is passed
on to the node, so nodes either share the proxy's keys or have none. Errors of the proxy itself have
the api_server's OpenAI shape (:mod:`lmdeploy.serve.openai.errors`).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import random
import time
from collections import OrderedDict
from typing import List, Optional, Sequence

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from lmdeploy.serve.openai.errors import APIError, error_body, error_response, install_error_handlers

from .forward import Admission, Forwarder, ProxyError
from .health import HealthChecker
from .nodes import NodeTable, normalize_url
from .strategies import STRATEGIES

logger = logging.getLogger('lmdeploy.serve.proxy')

DEFAULT_MAX_BODY_BYTES = 16 << 20


class NodeIn(BaseModel):
    url: str = Field(description='the node\'s base URL, e.g. http://10.0.0.2:23333')
    models: Optional[List[str]] = Field(None, description='models it serves; omitted: asked of its /v1/models')
    speed: Optional[float] = Field(None, gt=0, description='requests a second, until the proxy has measured it')
    max_batch_size: Optional[int] = Field(None, ge=1, description='sequences its engine runs at once: how many '
                                          'requests the proxy keeps at it (plus a few; see --node-slots)')
    heartbeat: bool = Field(False, description='a live node registering again (every so often): ignored for a '
                            'node removed on request, which only a fresh registration brings back')


class NodeRef(BaseModel):
    url: str


class _Keys:
    """The accepted API keys, compared in constant time."""

    def __init__(self, keys: Optional[Sequence[str]]):
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys or () if k]

    def check(self, request: Request):
        if not self.digests:
            return
        auth = request.headers.get('authorization', '')
        scheme, _, key = auth.partition(' ')
        given = hashlib.sha256(key.strip().encode()).digest()
        ok = False
        for d in self.digests:
            ok |= hmac.compare_digest(given, d)
        if scheme.lower() != 'bearer' or not key.strip() or not ok:
            msg = 'missing API key' if not auth else 'invalid API key'
            raise APIError(401, f'{msg}: send "Authorization: Bearer YOUR_KEY"', 'invalid_api_key')


def _is_local(request: Request) -> bool:
    """Whether the request comes from this machine (a loopback address, or a unix socket)."""
    if request.client is None or not request.client.host:
        return True
    try:
        return ipaddress.ip_address(request.client.host.strip('[]').split('%')[0]).is_loopback
    except ValueError:
        return False


def create_app(table: Optional[NodeTable] = None, *, strategy: str = 'min_expected_latency',
               api_keys: Optional[Sequence[str]] = None, health_interval: float = 10.0, drop_after: int = 3,
               forget_after: float = 3600.0, request_timeout: Optional[float] = 600.0, connect_timeout: float = 5.0,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, node_slots: Optional[int] = None,
               node_queue: Optional[int] = None, max_queue: Optional[int] = None,
               queue_timeout: Optional[float] = 60.0, seed: Optional[int] = None) -> FastAPI:
    """The proxy app. The HTTP client and the health check start with the app's lifespan (uvicorn's
    default; ``TestClient`` used as a context manager). ``node_slots``, ``node_queue``, ``max_queue``,
    ``queue_timeout``: see :class:`~lmdeploy.serve.proxy.forward.Admission`."""
    if strategy not in STRATEGIES:
        raise ValueError(f'unknown strategy {strategy!r}; choose one of {", ".join(STRATEGIES)}')
    table = table if table is not None else NodeTable()
    keys = _Keys(api_keys)
    timeout = httpx.Timeout(connect=connect_timeout, read=request_timeout, write=request_timeout, pool=None)
    # bad values fail here, before serving
    HealthChecker(table, None, health_interval, drop_after, forget_after=forget_after)
    admission = Admission(node_slots, node_queue, max_queue, queue_timeout, health_interval)
    removed: 'OrderedDict[str, None]' = OrderedDict()  # URLs removed on request: a heartbeat does not bring them back

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        # nodes are reached directly: an HTTP_PROXY meant for the outside world must not sit in between
        async with httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False, trust_env=False) as client:
            forwarder = app.state.forwarder = Forwarder(table, strategy, client, random.Random(seed), admission)
            checker = app.state.checker = HealthChecker(table, client, health_interval, drop_after,
                                                        forget_after=forget_after,
                                                        on_change=lambda: forwarder.dispatch(full=True))
            task = asyncio.create_task(checker.run())
            app.state.client = client
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    app = FastAPI(title='lmdeploy proxy', lifespan=lifespan,
                  description='Spreads OpenAI-compatible requests over several lmdeploy api_servers.')
    app.state.table = table
    install_error_handlers(app)

    @app.exception_handler(ProxyError)  # the most specific handler wins: APIError's, plus Retry-After
    async def _proxy_error(request: Request, exc: ProxyError):
        headers = {'Retry-After': str(exc.retry_after)} if exc.retry_after is not None else None
        return JSONResponse(error_body(exc.status, exc.message, exc.code, exc.param, exc.type),
                            status_code=exc.status, headers=headers)

    auth = [Depends(keys.check)]

    def manage(request: Request):
        """Who may edit the node table: a key holder, or without keys this machine only."""
        keys.check(request)
        if not keys.digests and not _is_local(request):
            raise APIError(403, 'this proxy has no API keys, so its node table is only edited from its own machine; '
                           'start it with --api-keys KEY (and the nodes with --proxy-api-key KEY) to register nodes '
                           'from other hosts', 'forbidden', type='permission_error')

    management = [Depends(manage)]

    async def read_body(request: Request) -> bytes:
        length = request.headers.get('content-length')
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise APIError(413, f'the request body is larger than {max_body_bytes} bytes', 'request_too_large')
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise APIError(413, f'the request body is larger than {max_body_bytes} bytes', 'request_too_large')
        return bytes(body)

    @app.get('/health')
    async def health():
        up = sum(n.healthy for n in table.nodes.values())
        if not up:
            return error_response(503, f'no healthy node ({len(table.nodes)} registered)', 'no_available_node',
                                  headers={'Retry-After': str(max(1, min(60, round(health_interval))))})
        return {'status': 'ok', 'healthy_nodes': up, 'nodes': len(table.nodes)}

    @app.get('/v1/models', dependencies=auth)
    async def models():
        now = int(time.time())
        return {'object': 'list', 'data': [{'id': m, 'object': 'model', 'created': now, 'owned_by': 'lmdeploy',
                                            'root': m} for m in table.model_names()]}

    @app.get('/nodes/status', dependencies=auth)
    async def nodes_status(request: Request):
        fw: Forwarder = request.app.state.forwarder
        nodes = table.status()
        for entry in nodes:
            n = table.get(entry['url'])
            entry['slots'], entry['node_queue'] = admission.slots(n), admission.unstarted(n)
        return {'strategy': strategy, 'nodes': nodes, 'queued_requests': fw.queued, 'retried_requests': fw.retried,
                'rejected_requests': fw.rejected, 'timed_out_requests': fw.timed_out}

    @app.post('/nodes/add', dependencies=management)
    async def nodes_add(node: NodeIn, request: Request):
        try:
            url = normalize_url(node.url)
        except ValueError as e:
            raise APIError(400, str(e), 'invalid_value', 'url')
        if node.heartbeat and url in removed:
            raise APIError(409, f'the node {url} was removed on request: register it afresh to add it again',
                           'node_removed', 'url', type='invalid_request_error')
        removed.pop(url, None)
        known = table.get(url)
        models = node.models or (known.models if known is not None else None) or \
            await _ask_models(request.app.state.client, url)
        added = table.add(url, models, node.speed, node.max_batch_size)
        if known is not None and not known.healthy:
            # it says it is up: ask it, and take it back at once if it answers (not at the next check)
            state = await request.app.state.checker.check(known, timeout=2.0)
            if state != 'unreachable':
                known.failed_checks = 0
                table.set_state(known, state, 'it registered again')
        request.app.state.forwarder.dispatch(full=True)
        return {'added': added.url, 'node': added.status()}

    @app.post('/nodes/remove', dependencies=management)
    async def nodes_remove(node: NodeRef, request: Request):
        if not table.remove(node.url, 'removed on request'):
            raise APIError(404, f'no node {node.url!r} is registered', 'node_not_found', 'url')
        url = normalize_url(node.url)
        removed[url] = None
        while len(removed) > 10_000:
            removed.popitem(last=False)
        request.app.state.forwarder.dispatch(full=True)
        return {'removed': url}

    async def forward(request: Request):
        body = await read_body(request)
        return await request.app.state.forwarder.forward(request, request.url.path, body)

    for path in ('/v1/chat/completions', '/v1/completions', '/generate', '/v1/{rest:path}'):
        app.add_api_route(path, forward, methods=['POST'], dependencies=auth, include_in_schema=path[-1] != '}')
    return app


async def _ask_models(client: httpx.AsyncClient, url: str) -> Optional[List[str]]:
    """A node's model names from its /v1/models; None (any model) when it does not say."""
    try:
        r = await client.get(url + '/v1/models', timeout=5)
        if r.status_code == 200:
            return [m['id'] for m in r.json()['data']] or None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    return None


def serve(server_name: str = '0.0.0.0', server_port: int = 8000, *, strategy: str = 'min_expected_latency',
          api_keys: Optional[Sequence[str]] = None, health_interval: float = 10.0, drop_after: int = 3,
          forget_after: float = 3600.0, request_timeout: Optional[float] = 600.0, state_file: Optional[str] = None,
          nodes: Sequence[str] = (), node_slots: Optional[int] = None, node_queue: Optional[int] = None,
          max_queue: Optional[int] = None, queue_timeout: Optional[float] = 60.0, log_level: str = 'INFO') -> int:
    """Run the proxy until SIGINT / SIGTERM. ``nodes``: URLs added at start-up (besides the state file's)."""
    import uvicorn

    from lmdeploy.log import configure
    configure(log_level.upper())
    table = NodeTable(state_file)
    for url in nodes:
        table.add(url)
    app = create_app(table, strategy=strategy, api_keys=api_keys, health_interval=health_interval,
                     drop_after=drop_after, forget_after=forget_after, request_timeout=request_timeout,
                     node_slots=node_slots, node_queue=node_queue, max_queue=max_queue, queue_timeout=queue_timeout)
    uv_level = 'info' if log_level.upper() == 'DEBUG' else 'warning'  # uvicorn's access log: only when debugging
    logger.warning('proxy on http://%s:%d (strategy %s, %d node(s))', server_name, server_port, strategy,
                   len(table.nodes))
    if not api_keys:
        logger.warning('no --api-keys: anyone who reaches the proxy may use it, and nodes may only be added or '
                       'removed from this machine')
    from lmdeploy.serve.openai.uvicorn_server import make_server_class
    config = uvicorn.Config(app, host=server_name, port=server_port, log_level=uv_level, timeout_graceful_shutdown=30)
    server = make_server_class()(config)  # SIGTERM / SIGINT: finish the running streams, then return 0
    server.run()
    return 0 if server.started else 1
