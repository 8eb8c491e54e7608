"""Passing a request to a node: wait for a node with room, retry on another while the request has
not started, then pass the answer back - a stream chunk by chunk as it arrives, anything else whole.

Room. The proxy keeps at most ``slots`` requests at a node at once (its engine's batch plus a few
queued; see :class:`Admission`), and at most ``node_queue`` streamed requests that it has not begun
answering (the api_server sends a stream's headers with its first token, so these are the ones
queued in its engine; an engine whose KV cache runs out before its batch is full fills up here).
A request that finds no node with room waits in the proxy's queue, first come first served, and
goes to the first node that has room: a node that finishes early takes the next request, instead
of each node being handed a share up front by speed estimates. The queue is bounded: a request
that would wait behind ``max_queue`` others per node that could take it is answered 429
(``queue_full``), and one that waited ``queue_timeout`` seconds 503 (``queue_timeout``), both with
``Retry-After``. Among the nodes with room the strategy picks (:mod:`.strategies`). A ``/generate``
that only cancels or ends a session does no work on the node and never waits: it goes at once.

A request "has not started" while its node has sent no response headers: the connection was
refused, reset or timed out first, or the node answered 503 (loading, draining, engine gone) or
429, which it does before doing any work. Such a request is sent to the next node (ahead of the
queue), each node at most once. A non-streamed answer is read whole before the client sees a
byte, so a node that dies while sending it is also retried. A stream that has sent bytes is never
replayed: if its node fails, the client gets an error event (SSE, then ``data: [DONE]``) or error
line (NDJSON), as from the api_server itself, and the stream ends.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

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
# the proxy's server (uvicorn) writes its own: a node's would make them twice
_OWN = {'date', 'server'}
_STREAM_TYPES = ('text/event-stream', 'application/x-ndjson')
NODE_HEADER = 'x-lmdeploy-node'
DEFAULT_SLOTS = 64  # for a node that did not say its batch size (the cpu device's default batch)
_SERVER_ERROR = 'internal_server_error'  # the type of the api_server's own mid-stream errors


@dataclass
class Admission:
    """How much work the proxy lets wait, at each node and in front of them.

    node_slots: requests kept at one node at once; None: its ``max_batch_size`` (as it registered)
        plus an eighth (at least 2), or DEFAULT_SLOTS for a node that did not say.
    node_queue: streamed requests at one node that it has not begun answering; None: a quarter of its
        slots (at least 4: an engine filling its batch prefills several at once).
    max_queue: requests that may wait in the proxy per node that could take them; None: as many as
        that node's slots; 0: none wait (429 at once when every node is full).
    queue_timeout: seconds a request may wait in the proxy (503 after); None: no limit.
    retry_hint: the Retry-After (seconds) of a 503 for no healthy node (the health check's interval).
    """
    node_slots: Optional[int] = None
    node_queue: Optional[int] = None
    max_queue: Optional[int] = None
    queue_timeout: Optional[float] = 60.0
    retry_hint: float = 10.0

    def __post_init__(self):
        for name in ('node_slots', 'node_queue'):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):
                raise ValueError(f'{name} must be an integer >= 1 (or None: from the node), got {v!r}')
        if self.max_queue is not None and not (isinstance(self.max_queue, int) and self.max_queue >= 0):
            raise ValueError(f'max_queue must be an integer >= 0 (or None: a node\'s slots), got {self.max_queue!r}')
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            raise ValueError(f'queue_timeout must be > 0 seconds (or None: no limit), got {self.queue_timeout!r}')

    def slots(self, node: Node) -> int:
        if self.node_slots is not None:
            return self.node_slots
        b = node.max_batch_size
        return b + max(2, b // 8) if b else DEFAULT_SLOTS

    def unstarted(self, node: Node) -> int:
        return self.node_queue if self.node_queue is not None else max(4, self.slots(node) // 4)

    def queue(self, node: Node) -> int:
        return self.max_queue if self.max_queue is not None else self.slots(node)

    def has_room(self, node: Node) -> bool:
        return node.unfinished < self.slots(node) and node.unstarted < self.unstarted(node)


class ProxyError(APIError):
    """An error of the proxy itself, with the ``Retry-After`` a client should wait (None: none)."""

    def __init__(self, status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
                 type: Optional[str] = None, retry_after: Optional[int] = None):
        super().__init__(status, message, code, param, type)
        self.retry_after = retry_after


class _Waiter:
    """A request waiting for a node with room; its future gets (node, requests then in flight there)."""
    __slots__ = ('model', 'session', 'stream', 'tried', 'last', 'future')

    def __init__(self, model, session, stream, tried, last):
        self.model, self.session, self.stream, self.tried, self.last = model, session, stream, tried, last
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()


class Forwarder:
    """Sends requests to the table's nodes by ``strategy``, as they have room; keeps /generate sessions
    on their node."""

    def __init__(self, table: NodeTable, strategy: str, client: httpx.AsyncClient,
                 rng: Optional[random.Random] = None, admission: Optional[Admission] = None,
                 max_sessions: int = 100_000):
        self.table = table
        self.strategy = strategy
        self.client = client
        self.rng = rng or random.Random()
        self.admission = admission or Admission()
        self.retried = 0  # requests a node never started, sent on to another
        self.rejected = 0  # answered 429: the queue was full
        self.timed_out = 0  # answered 503: waited queue_timeout
        self._queue: 'OrderedDict[_Waiter, None]' = OrderedDict()  # first come first served; retries first
        self._waiting: Counter = Counter()  # model -> waiters for it
        self._sessions: 'OrderedDict[object, str]' = OrderedDict()  # /generate session_id -> node url
        self._max_sessions = max_sessions

    @property
    def queued(self) -> int:
        return len(self._queue)

    # --------------------------------------------------------------- choosing
    def _candidates(self, model, tried) -> List[Node]:
        return [n for n in self.table.candidates(model) if n.url not in tried]

    def _pick(self, session, candidates: Sequence[Node], anyway: bool = False) -> Optional[Node]:
        """The node among ``candidates`` that gets the request now; None: it waits (for room, or for its
        session's node). ``anyway``: one with room or not (a request that does no work there)."""
        if session is not None:
            url = self._sessions.get(session)
            pinned = next((n for n in candidates if n.url == url), None)
            if pinned is not None:
                if not anyway and not self.admission.has_room(pinned):
                    return None
                self._sessions.move_to_end(session)
                return pinned
        free = [n for n in candidates if anyway or self.admission.has_room(n)]
        if not free:
            return None
        node = choose(self.strategy, free, self.rng)
        if session is not None:
            self._sessions[session] = node.url
            self._sessions.move_to_end(session)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return node

    def _no_node(self, model, last: Optional[str] = None) -> APIError:
        if last is not None:
            return ProxyError(503, f'every node failed this request; last: {last}', 'all_nodes_failed',
                              retry_after=self._hint())
        if not self.table.nodes:
            return ProxyError(503, 'no node is registered with the proxy', 'no_available_node',
                              retry_after=self._hint())
        if model is not None and not any(n.serves(model) for n in self.table.nodes.values()):
            names = ', '.join(self.table.model_names()) or 'none'
            return APIError(404, f"the model '{model}' does not exist (served: {names}; see GET /v1/models)",
                            'model_not_found', 'model')
        return ProxyError(503, f'no healthy node serves {"this request" if model is None else repr(model)} now '
                          f'({len(self.table.nodes)} registered; see GET /nodes/status)', 'no_available_node',
                          retry_after=self._hint())

    def _hint(self) -> int:
        return max(1, min(60, math.ceil(self.admission.retry_hint)))

    def _retry_after(self, candidates: Sequence[Node], waiting: int) -> int:
        """Seconds until the queue in front of ``candidates`` has about cleared, by their speeds."""
        rate = sum(n.speed() or 0.0 for n in candidates)
        return max(1, min(60, math.ceil((waiting + 1) / rate))) if rate > 0 else 1

    # ----------------------------------------------------------------- the queue
    def _enqueue(self, w: _Waiter, first: bool):
        self._queue[w] = None
        if first:
            self._queue.move_to_end(w, last=False)
        self._waiting[w.model] += 1

    def _unqueue(self, w: _Waiter):
        if w in self._queue:
            del self._queue[w]
            self._waiting[w.model] -= 1
            if not self._waiting[w.model]:
                del self._waiting[w.model]

    def _take(self, node: Node, stream: bool) -> int:
        in_flight = node.start()
        if stream:
            node.unstarted += 1
        return in_flight

    def _give_back(self, node: Node, stream: bool):
        """A slot that was given and not used (the client left, the proxy stops)."""
        if stream:
            node.unstarted = max(0, node.unstarted - 1)
        node.drop()
        self.dispatch()

    def dispatch(self, full: bool = False):
        """Give waiting requests the nodes that have room, first come first served. ``full``: also fail the
        ones no node can take any more (nodes went down or away): call it when the table changes."""
        if not self._queue:
            return
        room = lambda: any(n.healthy and self.admission.has_room(n) for n in self.table.nodes.values())  # noqa
        if not full and not room():
            return
        done = []
        for w in self._queue:
            if w.future.done():
                done.append(w)
                continue
            candidates = self._candidates(w.model, w.tried)
            if not candidates:
                done.append(w)
                w.future.set_exception(self._no_node(w.model, w.last))
                continue
            node = self._pick(w.session, candidates)
            if node is None:
                continue
            done.append(w)
            w.future.set_result((node, self._take(node, w.stream)))
            if not full and not room():
                break
        for w in done:
            self._unqueue(w)

    async def _acquire(self, model, session, stream: bool, tried, last, watch: '_ClientWatch',
                       control: bool = False) -> Optional[Tuple[Node, int]]:
        """A node with a slot taken for this request, and the requests then in flight there; None: the
        client left while it waited. ``control``: it does no work on the node, and goes at once."""
        candidates = self._candidates(model, tried)
        if not candidates:
            raise self._no_node(model, last)
        if control:
            node = self._pick(session, candidates, anyway=True)
            return node, self._take(node, stream)
        retry = bool(tried)
        w = _Waiter(model, session, stream, tried, last)
        self._enqueue(w, first=retry)
        self.dispatch()
        if not w.future.done():
            ahead = self._waiting[model] - 1
            bound = sum(self.admission.queue(n) for n in candidates)
            if not retry and ahead >= bound:  # a retried request was let in already
                self._unqueue(w)
                w.future.cancel()
                self.rejected += 1
                raise ProxyError(429, f'the proxy is at capacity: {ahead} request(s) wait for '
                                 f'{len(candidates)} node(s) already (at most {bound}); retry later', 'queue_full',
                                 type='rate_limit_error', retry_after=self._retry_after(candidates, ahead))
            try:
                await asyncio.wait({w.future, watch.task}, timeout=self.admission.queue_timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                self._abandon(w)
                raise
            if not w.future.done():
                self._abandon(w)
                if watch.gone:
                    return None
                self.timed_out += 1
                candidates = self._candidates(model, tried) or candidates
                raise ProxyError(503, f'no node had room for this request within {self.admission.queue_timeout:g} '
                                 's', 'queue_timeout', retry_after=self._retry_after(candidates, self.queued))
        if w.future.exception() is not None:
            raise w.future.exception()
        if watch.gone:
            self._abandon(w)
            return None
        return w.future.result()

    def _abandon(self, w: _Waiter):
        if not w.future.done():
            self._unqueue(w)
            w.future.cancel()
        elif not w.future.cancelled() and w.future.exception() is None:
            self._give_back(w.future.result()[0], w.stream)

    # ------------------------------------------------------------- forwarding
    async def forward(self, request: Request, path: str, body: bytes) -> Response:
        watch = _ClientWatch(request)
        try:
            return await self._forward(request, path, body, watch)
        finally:
            watch.close()

    async def _forward(self, request: Request, path: str, body: bytes, watch: '_ClientWatch') -> Response:
        model, session, stream, control = _routing_keys(path, body)
        headers = [(k, v) for k, v in request.headers.raw if k.decode('latin-1').lower() not in _HOP]
        tried, last = set(), None
        while True:
            got = await self._acquire(model, session, stream, tried, last, watch, control)
            if got is None:
                return Response(status_code=499)  # nobody reads it
            node, in_flight = got
            tried.add(node.url)
            unstarted = stream  # node.unstarted counts this request until its answer begins
            t0 = time.monotonic()
            up = None
            try:
                up = await watch.race(self.client.send(
                    self.client.build_request(request.method, node.url + path, headers=headers, content=body,
                                              params=request.query_params), stream=True))
                if up is None:  # the client went away: closing the connection cancels the node's work
                    self._release(node, 'drop', unstarted)
                    return Response(status_code=499)
                self._started(node, unstarted)
                unstarted = False
                if up.status_code in (503, 429):
                    text = (await up.aread()).decode('utf-8', 'replace')
                    await up.aclose()
                    raise _NotStarted(f'{node.url} answered {up.status_code}: {_message(text)}',
                                      state='not_ready' if up.status_code == 503 else None)
                if _is_stream(up):
                    return self._stream(node, up, t0, in_flight)
                data = b''.join([c async for c in up.aiter_raw()])
                await up.aclose()
            except (_NotStarted, httpx.TransportError) as e:
                if up is not None:
                    await up.aclose()
                if isinstance(e, _NotStarted):
                    last, state = str(e), e.state
                else:
                    last, state = f'{node.url}: {type(e).__name__}: {e}', 'unreachable'
                if state is not None:
                    self._mark_down(node, state, last)
                self._release(node, 'drop', unstarted)  # not a failed request: it is sent on
                self.retried += 1
                continue
            except BaseException:
                if up is not None:
                    await up.aclose()
                self._release(node, 'drop', unstarted)
                raise
            self._release(node, 'finish', False, time.monotonic() - t0, in_flight)
            return Response(data, status_code=up.status_code, headers=_answer_headers(up, node))

    def _started(self, node: Node, unstarted: bool):
        if unstarted:  # its answer began: it runs on the node now, a place in the node's queue is free
            node.unstarted = max(0, node.unstarted - 1)
            self.dispatch()

    def _release(self, node: Node, how: str, unstarted: bool, seconds: float = 0.0, in_flight: int = 1):
        if unstarted:
            node.unstarted = max(0, node.unstarted - 1)
        if how == 'finish':
            node.finish(seconds, in_flight)
        elif how == 'fail':
            node.fail()
        else:
            node.drop()
        self.dispatch()

    def _mark_down(self, node: Node, state: str, why: str):
        """A request found ``node`` down: no more requests until a health check finds it up. Counted
        apart from failed health checks, which alone drop a node."""
        if state == 'unreachable':
            node.connect_failures += 1
        if node.state != 'dropped':
            self.table.set_state(node, state, f'{why}; the health check will look again')
        self.dispatch(full=True)

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
                err = error_body(502, msg, 'node_failed', type=_SERVER_ERROR)
                end = b'\n\n' if sse else b'\n'  # the error starts on a line (an event) of its own
                lead = b'' if tail.endswith(end) else end
                yield lead + (f'data: {json.dumps(err)}\n\ndata: [DONE]\n\n' if sse else
                              json.dumps(err) + '\n').encode()
            finally:
                if outcome == 'ok':
                    self._release(node, 'finish', False, time.monotonic() - t0, in_flight)
                else:
                    self._release(node, 'fail' if outcome == 'failed' else 'drop', False)
                await up.aclose()

        return StreamingResponse(chunks(), status_code=up.status_code, headers=_answer_headers(up, node))


class _NotStarted(Exception):

    def __init__(self, msg: str, state: Optional[str] = 'unreachable'):
        super().__init__(msg)
        self.state = state  # what it says of the node (None: nothing; a 429 is a busy node, not a down one)


class _ClientWatch:
    """Notices the client's disconnect while the proxy waits (for room, for the node's answer)."""

    def __init__(self, request: Request):
        self._receive = request.receive
        self.task = asyncio.ensure_future(self._gone())

    async def _gone(self):
        while True:
            message = await self._receive()
            if message['type'] == 'http.disconnect':
                return

    @property
    def gone(self) -> bool:
        return self.task.done() and not self.task.cancelled()

    async def race(self, coro):
        """``await coro``, unless the client disconnects first: then it is cancelled and None returned."""
        task = asyncio.ensure_future(coro)
        try:
            await asyncio.wait({task, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if task.cancelled() or not task.done():
            return None
        return task.result()

    def close(self):
        self.task.cancel()  # before the response is sent: a streaming response listens for the disconnect itself


def _is_stream(up: httpx.Response) -> bool:
    return up.headers.get('content-type', '').split(';')[0].strip() in _STREAM_TYPES


def _answer_headers(up: httpx.Response, node: Node) -> dict:
    out = {}
    for k, v in up.headers.multi_items():
        if k.lower() not in _HOP and k.lower() not in _OWN:
            out[k] = v
    out[NODE_HEADER] = node.url
    return out


def _message(text: str) -> str:
    try:
        return json.loads(text)['error']['message']
    except (ValueError, KeyError, TypeError):
        return text[:200]


def _routing_keys(path: str, body: bytes) -> Tuple[Optional[str], object, bool, bool]:
    """(model, /generate session id, whether a stream is asked for, whether it only cancels or ends a
    /generate session) of a JSON body; None / False for what it does not name."""
    if not body or body.lstrip()[:1] != b'{':
        return None, None, False, False
    try:
        obj = json.loads(body)
    except ValueError:
        return None, None, False, False  # the node answers it with its own 400
    if not isinstance(obj, dict):
        return None, None, False, False
    model = obj.get('model') if isinstance(obj.get('model'), str) else None
    session = obj.get('session_id') if path == '/generate' and isinstance(obj.get('session_id'), int) else None
    if session is not None and session < 0:
        session = None  # -1: the node picks an id
    control = path == '/generate' and (obj.get('cancel') is True or obj.get('end_session') is True)
    return model, session, obj.get('stream') is True, control
