"""Passing a request to a node: pick one, retry on another while the request has not started, then
pass the answer back - a stream chunk by chunk as it arrives, anything else whole.

A request "has not started" while its node has sent no response headers: the connection was
refused, reset or timed out first, or the node answered 503 (loading, draining, engine gone), which
it does before doing any work. Such a request is sent to the next node, each node at most once. A
non-streamed answer is read whole before the client sees a byte, so a node that dies while sending
it is also retried. A stream that has sent bytes is never replayed: if its node fails, the client
gets an error event (SSE) or error line (NDJSON), as from the api_server itself, and the stream ends.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import OrderedDict
from typing import Optional, Tuple

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from lmdeploy.serve.openai.errors import APIError, error_body

from .nodes import Node, NodeTable
from .strategies import choose

logger = logging.getLogger('lmdeploy.serve.proxy')

# headers that belong to one connection, not to the request or answer
_HOP = {'connection', 'keep-alive', 'proxy-authenticate', 'proxy-authorization', 'te', 'trailer', 'trailers',
        'transfer-encoding', 'upgrade', 'host', 'content-length'}
_STREAM_TYPES = ('text/event-stream', 'application/x-ndjson')
NODE_HEADER = 'x-lmdeploy-node'


class Forwarder:
    """Sends requests to the table's nodes by ``strategy``; keeps /generate sessions on their node."""

    def __init__(self, table: NodeTable, strategy: str, client: httpx.AsyncClient,
                 rng: Optional[random.Random] = None, max_sessions: int = 100_000):
        self.table = table
        self.strategy = strategy
        self.client = client
        self.rng = rng or random.Random()
        self.retried = 0  # requests a node never started, sent on to another
        self._sessions: 'OrderedDict[object, str]' = OrderedDict()  # /generate session_id -> node url
        self._max_sessions = max_sessions

    # --------------------------------------------------------------- choosing
    def _pick(self, model, session, tried) -> Optional[Node]:
        nodes = [n for n in self.table.candidates(model) if n.url not in tried]
        if not nodes:
            return None
        if session is not None:
            url = self._sessions.get(session)
            for n in nodes:
                if n.url == url:
                    self._sessions.move_to_end(session)
                    return n
        node = choose(self.strategy, nodes, self.rng)
        if session is not None:
            self._sessions[session] = node.url
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return node

    def _no_node(self, model) -> APIError:
        if not self.table.nodes:
            return APIError(503, 'no node is registered with the proxy', 'no_available_node')
        if model is not None and not any(n.serves(model) for n in self.table.nodes.values()):
            names = ', '.join(self.table.model_names()) or 'none'
            return APIError(404, f"the model '{model}' does not exist (served: {names}; see GET /v1/models)",
                            'model_not_found', 'model')
        return APIError(503, f'no healthy node serves {"this request" if model is None else repr(model)} now '
                        f'({len(self.table.nodes)} registered; see GET /nodes/status)', 'no_available_node')

    # ------------------------------------------------------------- forwarding
    async def forward(self, request: Request, path: str, body: bytes) -> Response:
        model, session = _routing_keys(path, body)
        headers = [(k, v) for k, v in request.headers.raw if k.decode('latin-1').lower() not in _HOP]
        tried, last = set(), None
        while True:
            node = self._pick(model, session, tried)
            if node is None:
                if last is None:
                    raise self._no_node(model)
                raise APIError(503, f'every node failed this request; last: {last}', 'all_nodes_failed')
            tried.add(node.url)
            in_flight = node.start()
            t0 = time.monotonic()
            up = None
            try:
                up = await _race_disconnect(request, self.client.send(
                    self.client.build_request(request.method, node.url + path, headers=headers, content=body,
                                              params=request.query_params), stream=True))
                if up is None:  # the client went away: closing the connection cancels the node's work
                    node.drop()
                    return Response(status_code=499)
                if up.status_code == 503:
                    text = (await up.aread()).decode('utf-8', 'replace')
                    await up.aclose()
                    raise _NotStarted(f'{node.url} answered 503: {_message(text)}', ready=False)
                if _is_stream(up):
                    return self._stream(node, up, t0, in_flight)
                data = b''.join([c async for c in up.aiter_raw()])
                await up.aclose()
            except (_NotStarted, httpx.TransportError) as e:
                if up is not None:
                    await up.aclose()
                ready = getattr(e, 'ready', True)
                last = str(e) if isinstance(e, _NotStarted) else f'{node.url}: {type(e).__name__}: {e}'
                node.drop()  # not a failed request: it is sent on
                self._mark_down(node, 'not_ready' if not ready else 'unreachable', last)
                self.retried += 1
                continue
            except BaseException:
                node.drop()
                if up is not None:
                    await up.aclose()
                raise
            node.finish(time.monotonic() - t0, in_flight)
            return Response(data, status_code=up.status_code, headers=_answer_headers(up, node))

    def _mark_down(self, node: Node, state: str, why: str):
        if state == 'unreachable':
            node.failures += 1
        if node.state != state:
            logger.warning('node %s is %s (%s); the health check will look again', node.url,
                           state.replace('_', ' '), why)
        node.state = state

    def _stream(self, node: Node, up: httpx.Response, t0: float, in_flight: int) -> StreamingResponse:
        sse = up.headers.get('content-type', '').startswith('text/event-stream')

        async def chunks():
            outcome = 'gone'  # the client went away (or the proxy stops) unless set otherwise
            tail = b'\n\n'
            try:
                async for chunk in up.aiter_raw():
                    if chunk:
                        tail = (tail + chunk)[-2:]
                    yield chunk
                outcome = 'ok'
            except httpx.TransportError as e:
                outcome = 'failed'
                # bytes were sent already: never replayed; the client is told, as the api_server tells it
                msg = f'the node {node.url} failed mid-stream ({type(e).__name__}); the answer is incomplete'
                logger.warning(msg)
                self._mark_down(node, 'unreachable', f'{type(e).__name__}: {e}')
                err = error_body(502, msg, 'node_failed')
                end = b'\n\n' if sse else b'\n'  # the error starts on a line (an event) of its own
                lead = b'' if tail.endswith(end) else end
                yield lead + (f'data: {json.dumps(err)}\n\n' if sse else json.dumps(err) + '\n').encode()
            finally:
                if outcome == 'ok':
                    node.finish(time.monotonic() - t0, in_flight)
                elif outcome == 'failed':
                    node.fail()
                else:
                    node.drop()
                await up.aclose()

        return StreamingResponse(chunks(), status_code=up.status_code, headers=_answer_headers(up, node))


class _NotStarted(Exception):

    def __init__(self, msg: str, ready: bool = True):
        super().__init__(msg)
        self.ready = ready


def _is_stream(up: httpx.Response) -> bool:
    return up.headers.get('content-type', '').split(';')[0].strip() in _STREAM_TYPES


def _answer_headers(up: httpx.Response, node: Node) -> dict:
    out = {}
    for k, v in up.headers.multi_items():
        if k.lower() not in _HOP:
            out[k] = v
    out[NODE_HEADER] = node.url
    return out


def _message(text: str) -> str:
    try:
        return json.loads(text)['error']['message']
    except (ValueError, KeyError, TypeError):
        return text[:200]


def _routing_keys(path: str, body: bytes) -> Tuple[Optional[str], object]:
    """(model, /generate session id) named by a JSON body; None for what it does not name."""
    if not body or body.lstrip()[:1] != b'{':
        return None, None
    try:
        obj = json.loads(body)
    except ValueError:
        return None, None  # the node answers it with its own 400
    if not isinstance(obj, dict):
        return None, None
    model = obj.get('model') if isinstance(obj.get('model'), str) else None
    session = obj.get('session_id') if path == '/generate' and isinstance(obj.get('session_id'), int) else None
    if session is not None and session < 0:
        session = None  # -1: the node picks an id
    return model, session


async def _race_disconnect(request: Request, coro):
    """``await coro``, unless the client disconnects first: then it is cancelled and None returned."""
    task = asyncio.ensure_future(coro)

    async def gone():
        while True:
            message = await request.receive()
            if message['type'] == 'http.disconnect':
                return

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        return None
    return task.result()
