"""The OpenAI-compatible REST server: ``lmdeploy serve api_server MODEL``.

Endpoints:

* ``GET  /v1/models``
* ``POST /v1/chat/completions`` (SSE streaming, ending with ``data: [DONE]``)
* ``POST /v1/completions``
* ``POST /generate`` - LMDeploy's native API: interactive sessions, streaming
  as newline-delimited JSON
* ``GET  /health`` (200 when ready, 503 while loading or shutting down)
* ``GET  /metrics`` (Prometheus; see :mod:`lmdeploy.serve.openai.metrics`)

Errors always have OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}``: 400 invalid values (a prompt plus ``max_tokens`` over
``session_len``, an unknown model, unsupported options), 401 a missing or
wrong API key, 404 unknown routes, 413 a body over the size limit, 422
malformed bodies (not JSON, wrong types, missing fields), 503 engine not
ready or server shutting down.

The :class:`~lmdeploy.frontend.gateway.Gateway` runs on the server's event
loop (it is async; the engine runs on its own thread). A client that goes
away cancels its requests; SIGTERM / SIGINT drain: no new requests, running
ones finish (up to ``drain_timeout``), then :func:`serve` returns 0.

Run it with ``lmdeploy serve api_server MODEL [flags]``, from Python with
:func:`serve`, or as ``python -m lmdeploy.serve.openai.api_server MODEL
[flags]`` (a subset of the flags).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple, Union

from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig

from . import protocol as P
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics

logger = logging.getLogger('lmdeploy.serve')

__all__ = ['create_app', 'serve', 'BackgroundServer', 'APIError', 'DEFAULT_MAX_BODY_BYTES', 'main']

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_DRAIN_TIMEOUT = 60
MAX_STOP_WORDS = 16
MAX_STOP_WORD_LEN = 256
MAX_PROMPTS = 256  # prompts in one /v1/completions request
_CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never received
# LMDeploy's server defaults
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 40

_OPEN_PATHS = ('/health', '/metrics', '/openapi.json', '/docs', '/docs/oauth2-redirect', '/redoc')
_TYPES = {400: 'invalid_request_error', 401: 'authentication_error', 404: 'invalid_request_error',
          405: 'invalid_request_error', 413: 'invalid_request_error', 422: 'invalid_request_error',
          500: 'internal_server_error', 503: 'service_unavailable_error'}
# pydantic error types that mean "a value out of range", answered with 400 (the rest are 422)
_VALUE_ERRORS = {'greater_than', 'greater_than_equal', 'less_than', 'less_than_equal', 'multiple_of',
                 'finite_number', 'too_short', 'too_long', 'string_too_short', 'string_too_long', 'value_error',
                 'literal_error', 'enum'}


def _validation_status(errors: List[Dict[str, Any]]) -> int:
    """400 when every field in error had the right shape but a bad value (for a
    union, some variant's value check failed); 422 when a field is missing or
    of the wrong type, or the body is not JSON."""
    by_field: Dict[Any, List[str]] = {}
    for e in errors:
        loc = [x for x in e.get('loc', ()) if x != 'body']
        by_field.setdefault(loc[0] if loc else None, []).append(e.get('type'))
    if not by_field:
        return 422
    for field_name, types in by_field.items():
        if field_name is None or not any(t in _VALUE_ERRORS for t in types):
            return 422
    return 400


# ---------------------------------------------------------------------- errors
class APIError(Exception):
    """Raised anywhere in a handler: becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or _TYPES.get(status, 'invalid_request_error')


def error_body(status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
               type: Optional[str] = None) -> Dict[str, Any]:
    return {'error': {'message': message, 'type': type or _TYPES.get(status, 'invalid_request_error'),
                      'param': param, 'code': code}}


def error_response(status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
                   headers: Optional[Dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


async def _send_json(send, status: int, body: Dict[str, Any], headers: Sequence[Tuple[bytes, bytes]] = ()):
    data = json.dumps(body).encode()
    await send({'type': 'http.response.start', 'status': status,
                'headers': [(b'content-type', b'application/json'), (b'content-length', str(len(data)).encode()),
                            *headers]})
    await send({'type': 'http.response.body', 'body': data})


class _ClientGone(Exception):
    pass


# ------------------------------------------------------------------- sessions
@dataclass
class _Session:
    internal_id: int  # the engine's session id
    turns: int = 0  # finished interactive turns (the engine holds their cache)
    busy: bool = False


class _Sessions:
    """Client session ids -> engine session ids.

    Client ids live in their own namespace, so a client choosing an id never
    collides with ids the server picks; an entry exists while a named request
    runs, and between the turns of an interactive session."""

    def __init__(self):
        self.by_client: Dict[int, _Session] = {}
        self._auto = 1 << 31

    def auto_id(self) -> int:
        while self._auto in self.by_client:
            self._auto += 1
        self._auto += 1
        return self._auto - 1


# ---------------------------------------------------------------------- state
class ServerState:
    """What the handlers share; ``app.state.lmdeploy``."""

    def __init__(self, gateway, model_name: Optional[str], api_keys: Optional[Sequence[str]],
                 max_log_len: Optional[int]):
        self.gateway = None
        self.model_name = model_name
        self.api_key_digests = [hashlib.sha256(k.encode()).digest() for k in (api_keys or []) if k]
        self.max_log_len = max_log_len
        self.draining = False
        self.sessions = _Sessions()
        self.metrics = ServerMetrics(lambda: self.gateway.engine if self.gateway is not None else None)
        if gateway is not None:
            self.set_gateway(gateway)

    def set_gateway(self, gateway):
        """Attach the gateway (an app created with ``gateway=None`` answers 503 until then)."""
        self.gateway = gateway
        if not self.model_name:
            self.model_name = gateway.model_name

    def key_ok(self, key: Optional[str]) -> bool:
        if not self.api_key_digests:
            return True
        given = hashlib.sha256((key or '').encode()).digest()
        ok = False
        for digest in self.api_key_digests:  # no early exit: constant time over the keys
            ok |= hmac.compare_digest(given, digest)
        return ok and bool(key)

    def not_ready(self) -> Optional[Tuple[str, str]]:
        """(message, code) when requests cannot be served now, else None."""
        if self.draining:
            return 'the server is shutting down', 'shutting_down'
        if self.gateway is None:
            return 'the engine is not ready yet', 'engine_not_ready'
        engine = self.gateway.engine
        if not engine.is_alive():
            return 'the engine has stopped', 'engine_stopped'
        return None

    def clip(self, text: str) -> str:
        if self.max_log_len is None or len(text) <= self.max_log_len:
            return text
        return text[:self.max_log_len] + f'...[{len(text) - self.max_log_len} more]'


# ------------------------------------------------------------------ middleware
class _GuardMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched): API keys,
    readiness, the body size limit, and error counting."""

    def __init__(self, app, state: ServerState, max_body_bytes: int):
        self.app = app
        self.state = state
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope['type'] != 'http':
            return await self.app(scope, receive, send)
        metrics = self.state.metrics

        async def counting_send(message):
            if message['type'] == 'http.response.start' and message['status'] >= 400:
                metrics.http_errors.labels(str(message['status'])).inc()
            await send(message)

        path, method = scope['path'], scope['method']
        protected = (path.startswith('/v1/') or path == '/generate') and method != 'OPTIONS'
        headers = dict(scope.get('headers') or [])
        if protected and self.state.api_key_digests:
            auth = headers.get(b'authorization', b'').decode('latin-1')
            scheme, _, key = auth.partition(' ')
            if scheme.lower() != 'bearer' or not self.state.key_ok(key.strip()):
                msg = 'missing API key' if not auth else 'invalid API key'
                return await _send_json(counting_send, 401, error_body(
                    401, f'{msg}: send "Authorization: Bearer YOUR_KEY"', 'invalid_api_key'),
                    [(b'www-authenticate', b'Bearer')])
        if protected:
            why = self.state.not_ready()
            if why is not None:
                return await _send_json(counting_send, 503, error_body(503, why[0], why[1]),
                                        [(b'retry-after', b'5')] if why[1] == 'engine_not_ready' else [])
        limit = self.max_body_bytes
        too_big = error_body(413, f'the request body is larger than {limit} bytes', 'request_too_large')
        length = headers.get(b'content-length')
        if length is not None and length.isdigit() and int(length) > limit:
            return await _send_json(counting_send, 413, too_big, [(b'connection', b'close')])
        if method not in ('POST', 'PUT', 'PATCH'):
            return await self.app(scope, receive, counting_send)
        body = bytearray()
        while True:
            message = await receive()
            if message['type'] == 'http.disconnect':
                return
            body += message.get('body', b'')
            if len(body) > limit:
                return await _send_json(counting_send, 413, too_big, [(b'connection', b'close')])
            if not message.get('more_body', False):
                break
        content_type = headers.get(b'content-type', b'')
        if b'json' not in content_type and bytes(body[:64]).lstrip()[:1] in (b'{', b'['):
            # `curl -d '{...}'` sends JSON as a form: read it as the JSON it is
            scope = dict(scope)
            scope['headers'] = [(k, v) for k, v in scope['headers'] if k != b'content-type'] + [
                (b'content-type', b'application/json')]
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {'type': 'http.request', 'body': bytes(body), 'more_body': False}
            return await receive()

        await self.app(scope, replay, counting_send)


async def _wait_disconnect(receive):
    while True:
        message = await receive()
        if message['type'] == 'http.disconnect':
            return


async def _race(request: Request, coro):
    """Await ``coro``; if the client disconnects first, cancel it and raise _ClientGone."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise _ClientGone()


# ------------------------------------------------------------- generation jobs
@dataclass
class _Job:
    index: int
    input_ids: List[int]
    gen: GenerationConfig
    session_id: int  # the engine's
    interactive: bool = False
    stream: bool = True  # False: the engine hands over the whole result at the end (less per-token work)


@dataclass
class _Result:
    text: str = ''
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[Dict[int, float]] = field(default_factory=list)
    input_tokens: int = 0
    generated: int = 0
    finish_reason: Optional[str] = None
    error: Optional[str] = None


def _failed_early(out) -> bool:
    """An engine refusal or failure before any token was generated."""
    return bool(out.error) and out.generate_token_len == 0 and out.finish_reason is not None


class _Run:
    """One request's generations (one per prompt), merged into one stream of
    (index, GenOut). Outputs are pulled from the engine as they come, whatever
    the client's reading speed. :meth:`close` (synchronous, idempotent)
    cancels what still runs, which frees its KV blocks."""

    def __init__(self, state: ServerState, endpoint: str, jobs: List[_Job]):
        self.state = state
        gateway = state.gateway
        self.jobs = jobs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.timers = [state.metrics.timer(endpoint, streaming=job.stream) for job in jobs]
        for timer, job in zip(self.timers, jobs):
            timer.prompt_tokens = len(job.input_ids)
        self._generated = [0] * len(jobs)
        self._open = len(jobs)
        self._closed = False
        self.tasks = [asyncio.ensure_future(self._pump(job, gateway.generate(
            None, job.session_id, job.gen, input_ids=job.input_ids, interactive=job.interactive,
            stream_text=job.stream))) for job in jobs]

    async def _pump(self, job: _Job, gen):
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    self.queue.put_nowait((job.index, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never expected: report it as this prompt's failure
            logger.exception('generation failed')
            from lmdeploy.frontend.gateway import GenOut
            self.queue.put_nowait((job.index, GenOut('', len(job.input_ids), self._generated[job.index],
                                                     finish_reason='error', error=f'{type(e).__name__}: {e}')))
        finally:
            self.queue.put_nowait((job.index, None))

    async def next(self):
        """The next (index, GenOut), or None when every generation has finished."""
        while self._open > 0:
            index, out = await self.queue.get()
            if out is None:
                self._open -= 1
                continue
            timer = self.timers[index]
            timer.tokens(out.generate_token_len - self._generated[index])
            self._generated[index] = out.generate_token_len
            if out.finish_reason is not None:
                timer.prompt_tokens = out.input_token_len or timer.prompt_tokens
                timer.finish(out.finish_reason)
            return index, out
        return None

    async def firsts(self) -> List[Tuple[int, Any]]:
        """Wait for the first output of every generation (errors before generation show here)."""
        seen, items = set(), []
        while len(seen) < len(self.jobs):
            item = await self.next()
            if item is None:
                break
            items.append(item)
            seen.add(item[0])
        return items

    async def iterate(self, buffered) -> AsyncIterator[Tuple[int, Any]]:
        for item in buffered:
            yield item
        while (item := await self.next()) is not None:
            yield item

    def close(self):
        if self._closed:
            return
        self._closed = True
        for task in self.tasks:
            if not task.done():
                task.cancel()
        for timer in self.timers:
            timer.finish('abort')


def _accumulate(r: _Result, out):
    r.text += out.text
    r.token_ids.extend(out.token_ids)
    if out.logprobs:
        r.logprobs.extend(out.logprobs)
    r.input_tokens = out.input_token_len or r.input_tokens
    r.generated = out.generate_token_len
    if out.finish_reason is not None:
        r.finish_reason = out.finish_reason
    if out.error:
        r.error = out.error


def _raise_early_failure(items, state: ServerState):
    for _, out in items:
        if _failed_early(out):
            if out.finish_reason == 'abort' and (state.draining or 'shutting down' in (out.error or '')):
                raise APIError(503, out.error or 'the server is shutting down', 'shutting_down')
            code = 'context_length_exceeded' if out.finish_reason == 'length' else 'invalid_request'
            raise APIError(400, out.error, code)


class _StreamResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close`` (sync), however it ends:
    finished, client gone, or cancelled."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


_SSE_HEADERS = {'Cache-Control': 'no-cache', 'X-Accel-Buffering': 'no'}


def _sse(obj, with_usage: bool = True) -> str:
    if isinstance(obj, P._Model):
        obj = obj.model_dump(exclude_none=False)
        for choice in obj.get('choices') or []:
            delta = choice.get('delta')
            if isinstance(delta, dict):  # as OpenAI: a delta names only what it carries
                choice['delta'] = {k: v for k, v in delta.items() if v is not None}
        if not with_usage:  # OpenAI sends "usage" only with stream_options.include_usage
            obj.pop('usage', None)
    return f'data: {json.dumps(obj, ensure_ascii=False)}\n\n'


# ---------------------------------------------------------------- validation
def _check_model(state: ServerState, model: str):
    if model != state.model_name:
        raise APIError(400, f'the model {model!r} does not exist; this server serves {state.model_name!r} '
                       '(see GET /v1/models)', 'model_not_found', 'model')


def _stop_words(stop) -> Optional[List[str]]:
    if stop is None:
        return None
    words = [stop] if isinstance(stop, str) else list(stop)
    if len(words) > MAX_STOP_WORDS:
        raise APIError(400, f'stop: at most {MAX_STOP_WORDS} strings, got {len(words)}', param='stop')
    for w in words:
        if not w:
            raise APIError(400, 'stop: the strings must not be empty', param='stop')
        if len(w) > MAX_STOP_WORD_LEN:
            raise APIError(400, f'stop: each string has at most {MAX_STOP_WORD_LEN} characters', param='stop')
    return words or None


def _check_unsupported(req):
    if req.n not in (None, 1):
        raise APIError(400, f'n={req.n} is not supported: only n=1', 'unsupported_parameter', 'n')
    for name in ('presence_penalty', 'frequency_penalty'):
        if getattr(req, name):
            raise APIError(400, f'{name} is not supported (must be 0); use repetition_penalty',
                           'unsupported_parameter', name)
    if req.logit_bias:
        raise APIError(400, 'logit_bias is not supported', 'unsupported_parameter', 'logit_bias')


def _gen_config(state: ServerState, req, max_new_tokens: int, logprobs: Optional[int], *, temperature=None,
                top_p=None, top_k=None) -> GenerationConfig:
    temperature = req.temperature if temperature is None else temperature
    top_p = req.top_p if top_p is None else top_p
    top_k = req.top_k if top_k is None else top_k
    seed = req.seed
    vocab = state.gateway.engine.model_config.vocab_size
    try:
        return GenerationConfig(
            n=1, max_new_tokens=max_new_tokens, do_sample=True,
            temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
            top_p=DEFAULT_TOP_P if top_p is None else top_p,
            top_k=min(DEFAULT_TOP_K if top_k is None else top_k, vocab),
            min_p=req.min_p or 0.0,
            repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
            ignore_eos=bool(req.ignore_eos),
            # the sampler hashes 32 bits of the seed: any int maps onto them
            random_seed=None if seed is None else seed & 0xFFFFFFFF,
            stop_words=_stop_words(req.stop),
            min_new_tokens=req.min_new_tokens,
            skip_special_tokens=req.skip_special_tokens is not False,
            spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
            logprobs=logprobs,
            include_stop_str_in_output=bool(req.include_stop_str_in_output))
    except ValueError as e:
        raise APIError(400, str(e).replace('GenerationConfig.', ''), 'invalid_value') from None


def _max_new_tokens(state: ServerState, num_prompt: int, max_tokens: Optional[int], history: int = 0,
                    check: bool = True) -> int:
    session_len = state.gateway.session_len
    if num_prompt == 0:
        raise APIError(400, 'the prompt is empty', 'invalid_value', 'prompt')
    total = num_prompt + history
    if check and total >= session_len:
        raise APIError(400, f"This model's maximum context length is {session_len} tokens. However, the prompt "
                       f'has {total} tokens, leaving no room for the completion.', 'context_length_exceeded')
    if max_tokens is None:
        return max(1, session_len - total)
    if check and total + max_tokens > session_len:
        raise APIError(400, f"This model's maximum context length is {session_len} tokens. However, you requested "
                       f'{total + max_tokens} tokens ({total} in the prompt, {max_tokens} for the completion). '
                       'Please reduce the length of the prompt or of the completion.', 'context_length_exceeded',
                       'max_tokens')
    return max_tokens


def _check_ids(state: ServerState, ids: List[int], param: str) -> List[int]:
    vocab = state.gateway.engine.model_config.vocab_size
    if any(i < 0 or i >= vocab for i in ids):
        raise APIError(400, f'{param}: token ids must be in [0, {vocab})', 'invalid_value', param)
    return list(ids)


def _encode(state: ServerState, prompt, do_preprocess: bool = True, sequence_start: bool = True) -> List[int]:
    try:
        return state.gateway.encode_prompt(prompt, do_preprocess=do_preprocess, sequence_start=sequence_start)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), 'invalid_value', 'messages' if isinstance(prompt, list) else 'prompt') from None
    except Exception as e:  # a chat template that trips on the input is still the input's fault
        raise APIError(400, f'cannot render the prompt: {type(e).__name__}: {e}', 'invalid_value') from None


def _messages(messages) -> Union[str, List[Dict[str, Any]]]:
    if isinstance(messages, str):
        return messages
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if d.get('role') == 'developer':
            d['role'] = 'system'
        content = d.get('content')
        if isinstance(content, list):
            d['content'] = [p for p in content]
        d.pop('name', None)
        out.append({'role': d['role'], 'content': d.get('content')})
    return out


def _begin_session(state: ServerState, client_id: Optional[int],
                   exclusive: bool = False) -> Tuple[Optional[int], _Session]:
    """Lease the engine session for a request; a named one must not be busy
    (``exclusive``: must not exist at all, e.g. a live interactive session)."""
    gateway = state.gateway
    if client_id is None or client_id == -1:
        return None, _Session(gateway.next_session_id(), busy=True)
    sess = state.sessions.by_client.get(client_id)
    if sess is not None and (sess.busy or exclusive):
        what = 'busy with another request' if sess.busy else 'an interactive session (continue it with /generate)'
        raise APIError(400, f'session {client_id} is {what}', 'session_busy', 'session_id')
    if sess is None:
        sess = _Session(gateway.next_session_id())
        state.sessions.by_client[client_id] = sess
    sess.busy = True
    return client_id, sess


def _end_lease(state: ServerState, client_id: Optional[int], sess: _Session, keep: bool, failed: bool):
    """After a request: keep an interactive session, or forget it (freeing its cache)."""
    sess.busy = False
    if keep and not failed:
        sess.turns += 1
        return
    if sess.turns > 0 or keep:  # the engine may hold the session's cache: free it
        state.gateway.end_session(sess.internal_id)
    if client_id is not None and state.sessions.by_client.get(client_id) is sess:
        del state.sessions.by_client[client_id]


# ------------------------------------------------------------------- logprobs
class _TokenText:

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: Dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self.cache) < 65536:
                self.cache[token_id] = s
        return s


def _chat_logprobs(tt: _TokenText, token_ids: List[int], logprobs, top_n: int) -> P.ChatChoiceLogprobs:
    content = []
    for tid, lp in zip(token_ids, logprobs or []):
        tok = tt(tid)
        tops = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(P.ChatLogprob(token=tok, logprob=_finite(lp.get(tid, 0.0)), bytes=list(tok.encode()),
                                     top_logprobs=[P.TopLogprob(token=tt(i), logprob=_finite(v),
                                                                bytes=list(tt(i).encode())) for i, v in tops]))
    return P.ChatChoiceLogprobs(content=content)


def _completion_logprobs(tt: _TokenText, token_ids: List[int], logprobs, top_n: int,
                         offset: int = 0) -> P.CompletionLogprobs:
    out = P.CompletionLogprobs()
    for tid, lp in zip(token_ids, logprobs or []):
        tok = tt(tid)
        out.tokens.append(tok)
        out.token_logprobs.append(_finite(lp.get(tid, 0.0)))
        out.top_logprobs.append({tt(i): _finite(v) for i, v in sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def _finite(x: float) -> float:
    return max(float(x), -1e30)  # -inf is not JSON


def _usage(prompt: int, completion: int) -> P.UsageInfo:
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# ------------------------------------------------------------------------ app
def create_app(gateway=None, *, api_keys: Optional[Sequence[str]] = None, model_name: Optional[str] = None,
               allow_origins: Sequence[str] = ('*', ), allow_credentials: bool = False,
               allow_methods: Sequence[str] = ('*', ), allow_headers: Sequence[str] = ('*', ),
               max_log_len: Optional[int] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving ``gateway`` (a :class:`~lmdeploy.frontend.gateway.Gateway`).

    gateway: may be None; the app answers 503 until
        ``app.state.lmdeploy.set_gateway(gateway)``. The app never closes it.
    api_keys: if given, /v1/* and /generate need ``Authorization: Bearer KEY``
        (/health, /metrics and the docs stay open).
    model_name: the name /v1/models reports and requests must use (default:
        the gateway's, i.e. the model directory's name).
    max_log_len: characters of each prompt written to the log (INFO level);
        None: all.
    max_body_bytes: larger request bodies get a 413.
    """
    state = ServerState(gateway, model_name, api_keys, max_log_len)
    app = FastAPI(title='lmdeploy API server', version=_version(),
                  description='OpenAI-compatible REST API of lmdeploy (plus the native /generate).')
    app.state.lmdeploy = state
    bearer = HTTPBearer(auto_error=False, description='one of the server\'s --api-keys')
    auth = [Security(bearer)] if api_keys else []
    err = {status: {'model': P.ErrorResponse} for status in (400, 401, 413, 422, 503)}
    tt_cache: Dict[int, _TokenText] = {}

    def token_text() -> _TokenText:
        tok = state.gateway.tokenizer
        if id(tok) not in tt_cache:
            tt_cache.clear()
            tt_cache[id(tok)] = _TokenText(tok)
        return tt_cache[id(tok)]

    # ---------------------------------------------------------- error handlers
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.status, exc.message, exc.code, exc.param, exc.type),
                            status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        status = _validation_status(errors)
        parts, param = [], None
        for e in errors[:5]:
            loc = [str(x) for x in e.get('loc', ()) if x != 'body']
            param = param or ('.'.join(loc) or None)
            parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
        more = f' (and {len(errors) - 5} more)' if len(errors) > 5 else ''
        code = 'invalid_value' if status == 400 else 'invalid_body'
        return error_response(status, '; '.join(parts) + more, code, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f'{request.method} {request.url.path} not found'
        elif exc.status_code == 405:
            msg = f'method {request.method} is not allowed on {request.url.path}'
        else:
            msg = str(exc.detail)
        return error_response(exc.status_code, msg, {404: 'not_found', 405: 'method_not_allowed'}.get(
            exc.status_code), headers=getattr(exc, 'headers', None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception('unhandled error')
        return error_response(500, f'internal error: {type(exc).__name__}', 'internal_error')

    # ------------------------------------------------------------ simple routes
    @app.get('/health', response_model=P.HealthResponse, responses={503: {'model': P.ErrorResponse}})
    async def health():
        why = state.not_ready()
        if why is not None:
            return error_response(503, why[0], why[1])
        return P.HealthResponse(status='ok')

    @app.get('/metrics', response_class=Response, responses={200: {'content': {'text/plain': {}}}})
    async def metrics():
        data = await asyncio.to_thread(state.metrics.render)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.get('/v1/models', response_model=P.ModelList, dependencies=auth, responses=err)
    async def list_models():
        return P.ModelList(data=[P.ModelCard(id=state.model_name, root=state.model_name,
                                             max_model_len=state.gateway.session_len)])

    # ---------------------------------------------------------- the generators
    async def run_jobs(request: Request, endpoint: str, jobs: List[_Job]) -> Tuple[_Run, List]:
        """Start the jobs and wait for their first outputs (errors before generation: 4xx/503)."""
        run = _Run(state, endpoint, jobs)
        try:
            firsts = await _race(request, run.firsts())
            _raise_early_failure(firsts, state)
        except BaseException:
            run.close()
            raise
        return run, firsts

    async def finish_jobs(request: Request, run: _Run, firsts) -> List[_Result]:
        try:
            results = [_Result() for _ in run.jobs]
            for i, out in firsts:
                _accumulate(results[i], out)

            async def rest():
                while (item := await run.next()) is not None:
                    _accumulate(results[item[0]], item[1])
                return results

            return await _race(request, rest())
        finally:
            run.close()

    def log_request(rid: str, kind: str, prompt, ids: List[int], gen: GenerationConfig):
        if logger.isEnabledFor(logging.INFO):
            text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
            logger.info('%s %s: %d prompt tokens, max_new_tokens=%d, prompt=%r', kind, rid, len(ids),
                        gen.max_new_tokens, state.clip(text))

    # ------------------------------------------------------- chat completions
    @app.post('/v1/chat/completions', response_model=P.ChatCompletionResponse, dependencies=auth,
              responses={**err, 200: {'content': {'text/event-stream': {}}}})
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        _check_model(state, req.model)
        _check_unsupported(req)
        if req.tools:
            raise APIError(400, 'tools (function calling) are not supported', 'unsupported_parameter', 'tools')
        if req.response_format is not None and req.response_format.type != 'text':
            raise APIError(400, f'response_format {req.response_format.type!r} is not supported; only "text"',
                           'unsupported_parameter', 'response_format')
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, 'top_logprobs needs logprobs=true', 'invalid_value', 'top_logprobs')
        messages = _messages(req.messages)
        ids = _encode(state, messages)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_new = _max_new_tokens(state, len(ids), max_tokens)
        top_n = req.top_logprobs or 0
        gen = _gen_config(state, req, max_new, top_n if req.logprobs else None)
        rid = f'chatcmpl-{uuid.uuid4().hex}'
        log_request(rid, 'chat', messages, ids, gen)
        client_id, sess = _begin_session(state, req.session_id, exclusive=True)
        failed = True
        try:
            job = _Job(0, ids, gen, sess.internal_id, stream=bool(req.stream))
            run, firsts = await run_jobs(request, 'chat', [job])
            failed = False
        except _ClientGone:
            return Response(status_code=_CLIENT_GONE)
        finally:
            if failed:
                _end_lease(state, client_id, sess, keep=False, failed=True)
        created = int(time.time())
        tt = token_text()

        if not req.stream:
            try:
                results = await finish_jobs(request, run, firsts)
            except _ClientGone:
                return Response(status_code=_CLIENT_GONE)
            finally:
                _end_lease(state, client_id, sess, keep=False, failed=False)
            r = results[0]
            if r.finish_reason == 'error':
                raise APIError(500, f'generation failed: {r.error}', 'internal_error')
            logprobs = _chat_logprobs(tt, r.token_ids, r.logprobs, top_n) if req.logprobs else None
            return P.ChatCompletionResponse(
                id=rid, created=created, model=state.model_name,
                choices=[P.ChatCompletionChoice(message=P.ChatResponseMessage(content=r.text), logprobs=logprobs,
                                                finish_reason=r.finish_reason)],
                usage=_usage(r.input_tokens, r.generated))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: P.DeltaMessage, finish_reason=None, logprobs=None):
            return P.ChatCompletionStreamResponse(
                id=rid, created=created, model=state.model_name,
                choices=[P.ChatCompletionStreamChoice(delta=delta, finish_reason=finish_reason, logprobs=logprobs)])

        async def events():
            yield _sse(chunk(P.DeltaMessage(role='assistant', content='')), include_usage)
            r = _Result()
            async for _, out in run.iterate(firsts):
                _accumulate(r, out)
                if out.finish_reason == 'error':
                    yield _sse(error_body(500, f'generation failed: {out.error}', 'internal_error'))
                    break
                logprobs = (_chat_logprobs(tt, out.token_ids, out.logprobs, top_n)
                            if req.logprobs and out.token_ids else None)
                if out.text or out.finish_reason is not None or logprobs is not None:
                    yield _sse(chunk(P.DeltaMessage(content=out.text), out.finish_reason, logprobs), include_usage)
            if include_usage:
                yield _sse(P.ChatCompletionStreamResponse(id=rid, created=created, model=state.model_name,
                                                          choices=[], usage=_usage(r.input_tokens, r.generated)))
            yield 'data: [DONE]\n\n'

        def on_close():
            run.close()
            _end_lease(state, client_id, sess, keep=False, failed=False)

        return _StreamResponse(events(), on_close, media_type='text/event-stream', headers=_SSE_HEADERS)

    # ------------------------------------------------------------ completions
    @app.post('/v1/completions', response_model=P.CompletionResponse, dependencies=auth,
              responses={**err, 200: {'content': {'text/event-stream': {}}}})
    async def completions(req: P.CompletionRequest, request: Request):
        _check_model(state, req.model)
        _check_unsupported(req)
        if req.echo:
            raise APIError(400, 'echo is not supported', 'unsupported_parameter', 'echo')
        if req.suffix:
            raise APIError(400, 'suffix is not supported', 'unsupported_parameter', 'suffix')
        if req.best_of not in (None, 1):
            raise APIError(400, 'best_of is not supported: only 1', 'unsupported_parameter', 'best_of')
        prompt = req.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, 'the prompt is empty', 'invalid_value', 'prompt')
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f'at most {MAX_PROMPTS} prompts per request', 'invalid_value', 'prompt')
        if req.session_id not in (None, -1) and len(prompts) > 1:
            raise APIError(400, 'session_id needs a single prompt', 'invalid_value', 'session_id')
        all_ids = [_check_ids(state, p, 'prompt') if isinstance(p, list) else _encode(state, p, do_preprocess=False)
                   for p in prompts]
        max_news = [_max_new_tokens(state, len(ids), req.max_tokens) for ids in all_ids]
        top_n = req.logprobs
        gens = [_gen_config(state, req, m, top_n) for m in max_news]
        rid = f'cmpl-{uuid.uuid4().hex}'
        for p, ids, gen in zip(prompts, all_ids, gens):
            log_request(rid, 'completion', p if isinstance(p, str) else str(p), ids, gen)
        client_id, sess = _begin_session(state, req.session_id, exclusive=True)
        internal = [sess.internal_id] + [state.gateway.next_session_id() for _ in prompts[1:]]
        failed = True
        try:
            run, firsts = await run_jobs(request, 'completions', [
                _Job(i, ids, gen, sid, stream=bool(req.stream))
                for i, (ids, gen, sid) in enumerate(zip(all_ids, gens, internal))])
            failed = False
        except _ClientGone:
            return Response(status_code=_CLIENT_GONE)
        finally:
            if failed:
                _end_lease(state, client_id, sess, keep=False, failed=True)
        created = int(time.time())
        tt = token_text()

        if not req.stream:
            try:
                results = await finish_jobs(request, run, firsts)
            except _ClientGone:
                return Response(status_code=_CLIENT_GONE)
            finally:
                _end_lease(state, client_id, sess, keep=False, failed=False)
            for r in results:
                if r.finish_reason == 'error':
                    raise APIError(500, f'generation failed: {r.error}', 'internal_error')
            choices = [P.CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason,
                                          logprobs=(_completion_logprobs(tt, r.token_ids, r.logprobs, top_n)
                                                    if top_n is not None else None))
                       for i, r in enumerate(results)]
            return P.CompletionResponse(id=rid, created=created, model=state.model_name, choices=choices,
                                        usage=_usage(sum(r.input_tokens for r in results),
                                                     sum(r.generated for r in results)))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            results = [_Result() for _ in prompts]
            offsets = [0] * len(prompts)
            async for i, out in run.iterate(firsts):
                _accumulate(results[i], out)
                if out.finish_reason == 'error':
                    yield _sse(error_body(500, f'generation failed: {out.error}', 'internal_error'))
                    break
                logprobs = None
                if top_n is not None and out.token_ids:
                    logprobs = _completion_logprobs(tt, out.token_ids, out.logprobs, top_n, offsets[i])
                    offsets[i] += sum(len(t) for t in logprobs.tokens)
                if out.text or out.finish_reason is not None or logprobs is not None:
                    yield _sse(P.CompletionResponse(
                        id=rid, created=created, model=state.model_name,
                        choices=[P.CompletionChoice(index=i, text=out.text, logprobs=logprobs,
                                                    finish_reason=out.finish_reason)]), include_usage)
            if include_usage:
                yield _sse(P.CompletionResponse(id=rid, created=created, model=state.model_name, choices=[],
                                                usage=_usage(sum(r.input_tokens for r in results),
                                                             sum(r.generated for r in results))))
            yield 'data: [DONE]\n\n'

        def on_close():
            run.close()
            _end_lease(state, client_id, sess, keep=False, failed=False)

        return _StreamResponse(events(), on_close, media_type='text/event-stream', headers=_SSE_HEADERS)

    # --------------------------------------------------------------- generate
    @app.post('/generate', response_model=P.GenerateResponse, dependencies=auth,
              responses={**err, 200: {'content': {'application/x-ndjson': {}}}})
    async def generate(req: P.GenerateRequest, request: Request):
        sessions = state.sessions.by_client
        client_id = req.session_id
        if req.cancel:
            sess = sessions.get(client_id)
            if sess is not None:
                state.gateway.cancel(sess.internal_id)
            return P.GenerateResponse(text='', tokens=0, input_tokens=0, finish_reason='abort',
                                      session_id=client_id)
        empty = req.input_ids is None and req.prompt in ('', [])
        if req.end_session or (empty and not req.interactive_mode and client_id in sessions):
            sess = sessions.pop(client_id, None)
            if sess is not None:
                state.gateway.end_session(sess.internal_id)
            return P.GenerateResponse(text='', tokens=0, input_tokens=0, finish_reason='stop',
                                      session_id=client_id)
        if client_id == -1:
            client_id = state.sessions.auto_id()
        existing = sessions.get(client_id)
        if existing is not None and existing.busy:
            raise APIError(400, f'session {client_id} is busy with another request', 'session_busy', 'session_id')
        sequence_start = existing is None or existing.turns == 0
        if req.input_ids is not None:
            ids = _check_ids(state, req.input_ids, 'input_ids')
            prompt_for_log: Any = str(req.input_ids)
        else:
            prompt = req.prompt if isinstance(req.prompt, str) else _messages(req.prompt)
            ids = _encode(state, prompt, do_preprocess=req.do_preprocess, sequence_start=sequence_start)
            prompt_for_log = prompt
        # a continuation's history is in the engine: only the engine can check its length
        max_new = _max_new_tokens(state, len(ids), req.request_output_len, check=sequence_start)
        gen = _gen_config(state, req, max_new, req.logprobs)
        rid = f'generate-{uuid.uuid4().hex}'
        log_request(rid, 'generate', prompt_for_log, ids, gen)
        client_id, sess = _begin_session(state, client_id)
        keep = req.interactive_mode
        job = _Job(0, ids, gen, sess.internal_id, interactive=keep, stream=req.stream)
        outcome = {'failed': True}
        try:
            run, firsts = await run_jobs(request, 'generate', [job])
            outcome['failed'] = False
        except _ClientGone:
            return Response(status_code=_CLIENT_GONE)
        finally:
            if outcome['failed']:
                _end_lease(state, client_id, sess, keep=keep, failed=True)

        def response(r_text, tokens, input_tokens, finish_reason, token_ids, logprobs):
            return P.GenerateResponse(
                text=r_text, tokens=tokens, input_tokens=input_tokens,
                history_tokens=max(0, input_tokens - len(ids)), finish_reason=finish_reason, session_id=client_id,
                token_ids=list(token_ids), logprobs=[{str(k): _finite(v) for k, v in lp.items()}
                                                     for lp in logprobs] if req.logprobs is not None else None)

        if not req.stream:
            failed = True
            try:
                results = await finish_jobs(request, run, firsts)
                r = results[0]
                failed = r.finish_reason == 'error'
            except _ClientGone:
                return Response(status_code=_CLIENT_GONE)
            finally:
                _end_lease(state, client_id, sess, keep=keep, failed=failed)
            if r.finish_reason == 'error':
                raise APIError(500, f'generation failed: {r.error}', 'internal_error')
            return response(r.text, r.generated, r.input_tokens, r.finish_reason, r.token_ids, r.logprobs)

        async def lines():
            async for _, out in run.iterate(firsts):
                if out.finish_reason == 'error':
                    yield json.dumps(error_body(500, f'generation failed: {out.error}', 'internal_error')) + '\n'
                    return
                yield response(out.text, out.generate_token_len, out.input_token_len, out.finish_reason,
                               out.token_ids, out.logprobs or []).model_dump_json() + '\n'
            outcome['failed'] = False

        def on_close():
            run.close()
            _end_lease(state, client_id, sess, keep=keep, failed=outcome['failed'])

        # a stream that does not reach its end (client gone, error) ends the session
        outcome['failed'] = True
        return _StreamResponse(lines(), on_close, media_type='application/x-ndjson')

    # ------------------------------------------------------------ middleware
    app.add_middleware(_GuardMiddleware, state=state, max_body_bytes=max_body_bytes)
    app.add_middleware(CORSMiddleware, allow_origins=list(allow_origins), allow_credentials=allow_credentials,
                       allow_methods=list(allow_methods), allow_headers=list(allow_headers))
    return app


def _version() -> str:
    from lmdeploy.version import __version__
    return __version__


# ------------------------------------------------------------------- running
def _make_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, but SIGTERM / SIGINT mark the app as draining (new requests:
        503) and the process is not re-killed by the signal afterwards, so
        :func:`serve` returns 0 once running requests have finished."""

        def __init__(self, config, on_exit=None):
            super().__init__(config)
            self._on_exit = on_exit

        def request_exit(self):
            if self._on_exit is not None:
                self._on_exit()
            self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def handle(sig, frame):
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                logger.warning('received %s: draining (no new requests; running ones finish)',
                               signal.Signals(sig).name)
                self.request_exit()

            originals = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    return DrainingServer


class BackgroundServer:
    """Run an app with uvicorn on a background thread (tests, notebooks).

    ``with BackgroundServer(app) as srv: httpx.get(srv.url + '/health')``;
    ``port=0`` picks a free port. :meth:`stop` drains like SIGTERM does.
    """

    def __init__(self, app, host: str = '127.0.0.1', port: int = 0, drain_timeout: Optional[float] = 30,
                 log_level: str = 'warning', **config_kwargs):
        import uvicorn
        self.app = app
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan='off',
                                timeout_graceful_shutdown=drain_timeout, **config_kwargs)
        state = getattr(app.state, 'lmdeploy', None)
        self.server = _make_server_class()(config, on_exit=(lambda: setattr(state, 'draining', True))
                                           if state is not None else None)
        self.host = host
        self.port = port
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def _run(self):
        try:
            self.server.run()
        except BaseException as e:  # SystemExit from a failed bind included
            self._error = e

    def start(self, timeout: float = 60) -> 'BackgroundServer':
        self._thread = threading.Thread(target=self._run, name='lmdeploy-api-server', daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f'the server did not start: {self._error!r}')
            if time.monotonic() > deadline:
                raise TimeoutError('the server did not start in time')
            time.sleep(0.02)
        sockets = [s for srv in self.server.servers for s in srv.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f'http://{self.host}:{self.port}'

    def stop(self, timeout: float = 60):
        if self._thread is None:
            return
        self.server.request_exit()
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _chat_template_config(value):
    if value is None or not isinstance(value, str):
        return value
    from lmdeploy.frontend.chat_template import ChatTemplateConfig
    if os.path.isfile(value) or value.lstrip().startswith('{'):
        return ChatTemplateConfig.from_json(value)
    return ChatTemplateConfig(model_name=value)


def serve(model_path: Optional[str] = None, *, server_name: str = '0.0.0.0', server_port: int = 23333,
          backend: str = 'pytorch', backend_config: Union[PytorchEngineConfig, TurbomindEngineConfig, None] = None,
          chat_template_config=None, model_name: Optional[str] = None, api_keys: Optional[Sequence[str]] = None,
          ssl: bool = False, allow_origins: Sequence[str] = ('*', ), allow_credentials: bool = False,
          allow_methods: Sequence[str] = ('*', ), allow_headers: Sequence[str] = ('*', ),
          log_level: str = 'WARNING', max_log_len: Optional[int] = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, drain_timeout: Optional[float] = DEFAULT_DRAIN_TIMEOUT) -> int:
    """Load the model and serve it until SIGTERM / SIGINT; returns 0 after draining.

    model_path: a local Hugging Face directory; None or 'default': the
        embedded SmolLM2-135M-Instruct.
    backend: 'pytorch'; 'turbomind' is accepted and mapped onto it (a notice
        is logged).
    backend_config: PytorchEngineConfig (a TurbomindEngineConfig is mapped).
    chat_template_config: a ChatTemplateConfig, a builtin template name, or a
        JSON file / string with ChatTemplateConfig fields; None: the model's own.
    api_keys: accepted keys for ``Authorization: Bearer KEY`` on /v1/* and
        /generate; None: no authentication.
    ssl: serve HTTPS with the files named by $SSL_KEYFILE and $SSL_CERTFILE.
    allow_*: CORS settings.
    log_level: of the 'lmdeploy' logger (uvicorn's follows it).
    max_log_len: characters of each prompt logged (INFO); None: all.
    max_body_bytes: larger request bodies are refused with a 413.
    drain_timeout: seconds running requests get after SIGTERM before they
        are cancelled; None: wait for them however long.
    """
    import uvicorn

    from lmdeploy.default_model import resolve_model_path
    from lmdeploy.frontend.gateway import Gateway

    level = log_level.upper() if isinstance(log_level, str) else log_level
    root = logging.getLogger('lmdeploy')
    root.setLevel(level)
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter('%(asctime)s %(levelname)s %(name)s: %(message)s'))
        root.addHandler(handler)
    if backend == 'turbomind':
        logger.warning("the turbomind backend is not available in this build: serving with the pytorch engine")
    elif backend != 'pytorch':
        raise ValueError(f"backend must be 'pytorch' or 'turbomind', got {backend!r}")
    if isinstance(backend_config, TurbomindEngineConfig):
        backend_config = backend_config.to_pytorch()
    ssl_kwargs = {}
    if ssl:
        keyfile, certfile = os.environ.get('SSL_KEYFILE'), os.environ.get('SSL_CERTFILE')
        if not keyfile or not certfile:
            raise ValueError('ssl=True needs the environment variables SSL_KEYFILE and SSL_CERTFILE')
        for path in (keyfile, certfile):
            if not os.path.isfile(path):
                raise FileNotFoundError(f'SSL file {path!r} does not exist')
        ssl_kwargs = dict(ssl_keyfile=keyfile, ssl_certfile=certfile)
    chat_template_config = _chat_template_config(chat_template_config)
    gateway = Gateway(resolve_model_path(model_path), backend_config, chat_template_config, model_name)
    try:
        app = create_app(gateway, api_keys=api_keys, model_name=model_name, allow_origins=allow_origins,
                         allow_credentials=allow_credentials, allow_methods=allow_methods,
                         allow_headers=allow_headers, max_log_len=max_log_len, max_body_bytes=max_body_bytes)
        state: ServerState = app.state.lmdeploy
        uv_level = logging.getLevelName(level).lower() if isinstance(level, int) else level.lower()
        if uv_level not in ('critical', 'error', 'warning', 'info', 'debug', 'trace'):
            uv_level = 'warning'
        config = uvicorn.Config(app, host=server_name, port=server_port, log_level=uv_level, lifespan='off',
                                timeout_graceful_shutdown=drain_timeout, **ssl_kwargs)
        server = _make_server_class()(config, on_exit=lambda: setattr(state, 'draining', True))
        scheme = 'https' if ssl else 'http'
        logger.warning('serving %s on %s://%s:%d', state.model_name, scheme, server_name, server_port)
        server.run()
        if not server.started:
            return 1
        logger.warning('drained; bye')
        return 0
    finally:
        gateway.close()


# ----------------------------------------------------------------- __main__
def main(argv: Optional[List[str]] = None) -> int:
    """``python -m lmdeploy.serve.openai.api_server MODEL [flags]`` (the common
    flags; ``lmdeploy serve api_server`` has them all)."""
    import argparse
    p = argparse.ArgumentParser(prog='python -m lmdeploy.serve.openai.api_server')
    p.add_argument('model_path', nargs='?', default=None)
    p.add_argument('--server-name', default='0.0.0.0')
    p.add_argument('--server-port', type=int, default=23333)
    p.add_argument('--device', default='auto', choices=['auto', 'cuda', 'ascend', 'cpu'])
    p.add_argument('--session-len', type=int, default=None)
    p.add_argument('--max-batch-size', type=int, default=None)
    p.add_argument('--cache-max-entry-count', type=float, default=0.8)
    p.add_argument('--num-gpu-blocks', type=int, default=0)
    p.add_argument('--api-keys', nargs='+', default=None)
    p.add_argument('--model-name', default=None)
    p.add_argument('--chat-template', default=None)
    p.add_argument('--log-level', default='WARNING')
    p.add_argument('--max-log-len', type=int, default=None)
    p.add_argument('--drain-timeout', type=float, default=DEFAULT_DRAIN_TIMEOUT)
    args = p.parse_args(argv)
    config = PytorchEngineConfig(device_type=args.device, session_len=args.session_len,
                                 max_batch_size=args.max_batch_size,
                                 cache_max_entry_count=args.cache_max_entry_count,
                                 num_gpu_blocks=args.num_gpu_blocks)
    return serve(args.model_path, server_name=args.server_name, server_port=args.server_port, backend_config=config,
                 chat_template_config=args.chat_template, model_name=args.model_name, api_keys=args.api_keys,
                 log_level=args.log_level, max_log_len=args.max_log_len, drain_timeout=args.drain_timeout)


if __name__ == '__main__':
    import sys
    sys.exit(main())
