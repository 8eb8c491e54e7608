"""The proxy's FastAPI app and :func:`serve` (``lmdeploy serve proxy``).

Routes:

* ``GET  /v1/models`` - the models of the registered nodes, each once
* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /generate`` (and any other
  ``POST /v1/...``) - forwarded to a node chosen by the strategy (:mod:`.forward`)
* ``GET  /nodes/status``, ``POST /nodes/add``, ``POST /nodes/remove`` - the node table
* ``GET  /health`` - 200 while some node is healthy, else 503

With ``api_keys`` every route but ``/health`` (and the docs) needs ``Authorization: Bearer KEY``:
clients' requests and the nodes' registrations alike. The client's Authorization header is passed
on to the node, so nodes either share the proxy's keys or have none. Errors of the proxy itself have
the api_server's OpenAI shape (:mod:`lmdeploy.serve.openai.errors`).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import random
import time
from typing import List, Optional, Sequence

import httpx
from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, Field

from lmdeploy.serve.openai.errors import APIError, error_response, install_error_handlers

from .forward import Forwarder
from .health import HealthChecker
from .nodes import NodeTable, normalize_url
from .strategies import STRATEGIES

logger = logging.getLogger('lmdeploy.serve.proxy')

DEFAULT_MAX_BODY_BYTES = 16 << 20


class NodeIn(BaseModel):
    url: str = Field(description='the node\'s base URL, e.g. http://10.0.0.2:23333')
    models: Optional[List[str]] = Field(None, description='models it serves; omitted: asked of its /v1/models')
    speed: Optional[float] = Field(None, gt=0, description='requests a second, until the proxy has measured it')


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


def create_app(table: Optional[NodeTable] = None, *, strategy: str = 'min_expected_latency',
               api_keys: Optional[Sequence[str]] = None, health_interval: float = 10.0, drop_after: int = 3,
               request_timeout: Optional[float] = 600.0, connect_timeout: float = 5.0,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, seed: Optional[int] = None) -> FastAPI:
    """The proxy app. The HTTP client and the health check start with the app's lifespan (uvicorn's
    default; ``TestClient`` used as a context manager)."""
    if strategy not in STRATEGIES:
        raise ValueError(f'unknown strategy {strategy!r}; choose one of {", ".join(STRATEGIES)}')
    table = table if table is not None else NodeTable()
    keys = _Keys(api_keys)
    timeout = httpx.Timeout(connect=connect_timeout, read=request_timeout, write=request_timeout, pool=None)
    HealthChecker(table, None, health_interval, drop_after)  # bad values fail here, before serving

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        # nodes are reached directly: an HTTP_PROXY meant for the outside world must not sit in between
        async with httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False, trust_env=False) as client:
            app.state.forwarder = Forwarder(table, strategy, client, random.Random(seed))
            checker = HealthChecker(table, client, health_interval, drop_after)
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
    auth = [Depends(keys.check)]

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
            return error_response(503, f'no healthy node ({len(table.nodes)} registered)', 'no_available_node')
        return {'status': 'ok', 'healthy_nodes': up, 'nodes': len(table.nodes)}

    @app.get('/v1/models', dependencies=auth)
    async def models():
        now = int(time.time())
        return {'object': 'list', 'data': [{'id': m, 'object': 'model', 'created': now, 'owned_by': 'lmdeploy',
                                            'root': m} for m in table.model_names()]}

    @app.get('/nodes/status', dependencies=auth)
    async def nodes_status(request: Request):
        return {'strategy': strategy, 'nodes': table.status(),
                'retried_requests': request.app.state.forwarder.retried}

    @app.post('/nodes/add', dependencies=auth)
    async def nodes_add(node: NodeIn, request: Request):
        try:
            url = normalize_url(node.url)
        except ValueError as e:
            raise APIError(400, str(e), 'invalid_value', 'url')
        models = node.models or await _ask_models(request.app.state.client, url)
        added = table.add(url, models, node.speed)
        return {'added': added.url, 'node': added.status()}

    @app.post('/nodes/remove', dependencies=auth)
    async def nodes_remove(node: NodeRef):
        if not table.remove(node.url, 'removed on request'):
            raise APIError(404, f'no node {node.url!r} is registered', 'node_not_found', 'url')
        return {'removed': node.url.strip().rstrip('/')}

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
          request_timeout: Optional[float] = 600.0, state_file: Optional[str] = None,
          nodes: Sequence[str] = (), log_level: str = 'INFO') -> int:
    """Run the proxy until SIGINT / SIGTERM. ``nodes``: URLs added at start-up (besides the state file's)."""
    import uvicorn

    from lmdeploy.log import configure
    configure(log_level.upper())
    table = NodeTable(state_file)
    for url in nodes:
        table.add(url)
    app = create_app(table, strategy=strategy, api_keys=api_keys, health_interval=health_interval,
                     drop_after=drop_after, request_timeout=request_timeout)
    uv_level = 'info' if log_level.upper() == 'DEBUG' else 'warning'  # uvicorn's access log: only when debugging
    logger.warning('proxy on http://%s:%d (strategy %s, %d node(s))', server_name, server_port, strategy,
                   len(table.nodes))
    from lmdeploy.serve.openai.uvicorn_server import _make_server_class
    config = uvicorn.Config(app, host=server_name, port=server_port, log_level=uv_level, timeout_graceful_shutdown=30)
    server = _make_server_class()(config)  # SIGTERM / SIGINT: finish the running streams, then return 0
    server.run()
    return 0 if server.started else 1
