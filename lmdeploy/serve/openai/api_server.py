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
"code"}}``, with OpenAI's status codes: 400 invalid values (a prompt plus
``max_tokens`` over ``session_len``, unsupported options) and malformed
bodies (not JSON, wrong types, missing fields: code ``invalid_body``), 401 a
missing or wrong API key, 404 unknown routes and an unknown model, 413 a
body over the size limit, 503 engine not ready or server shutting down.

The :class:`~lmdeploy.frontend.gateway.Gateway` runs on the server's event
loop (it is async); the engine runs in a process of its own
(:mod:`lmdeploy.engine.process`; ``PytorchEngineConfig(engine_process=False)``
keeps it on a thread of this one). A client that goes
away cancels its requests; SIGTERM / SIGINT drain: no new requests, running
ones finish (up to ``drain_timeout``), then :func:`serve` returns 0.

Run it with ``lmdeploy serve api_server MODEL [flags]``, from Python with
:func:`serve`, or as ``python -m lmdeploy.serve.openai.api_server MODEL
[flags]`` (a subset of the flags).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from fastapi import FastAPI, Request, Security
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from fastapi.security import HTTPBearer

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig

from . import protocol as P
from .errors import APIError, error_body, error_response, install_error_handlers
from .guard import DEFAULT_MAX_BODY_BYTES, _GuardMiddleware
from .jobs import (_SSE_HEADERS, _accumulate, _Job, _race, _raise_early_failure, _Result, _Run, _sse, _StreamResponse,
                   _TextChunks)
from .metrics import CONTENT_TYPE_LATEST
from .params import (MAX_PROMPTS, _chat_logprobs, _check_ids, _check_model, _check_unsupported, _choices,
                     _completion_logprobs, _encode, _finite, _gen_config, _max_new_tokens, _messages,
                     _shares_prefill, _TokenText, _usage)
from .sessions import _Lease
from .state import ServerState

logger = logging.getLogger('lmdeploy.serve')

__all__ = ['create_app', 'serve', 'BackgroundServer', 'APIError', 'DEFAULT_MAX_BODY_BYTES', 'main']

DEFAULT_DRAIN_TIMEOUT = 60


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
    err = {status: {'model': P.ErrorResponse} for status in (400, 401, 404, 413, 503)}
    tt_cache: Dict[int, _TokenText] = {}

    def token_text() -> _TokenText:
        tok = state.gateway.tokenizer
        if id(tok) not in tt_cache:
            tt_cache.clear()
            tt_cache[id(tok)] = _TokenText(tok)
        return tt_cache[id(tok)]

    install_error_handlers(app)

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

    async def start(request: Request, endpoint: str, lease: _Lease, jobs: List[_Job]) -> Tuple[_Run, List]:
        """run_jobs under a lease: jobs that cannot start end it as failed."""
        try:
            return await run_jobs(request, endpoint, jobs)
        except BaseException:
            lease.end(failed=True)
            raise

    async def collect(request: Request, run: _Run, firsts, lease: _Lease) -> List[_Result]:
        """Everything a non-streaming request generates; its lease ends with it."""
        failed = True
        try:
            results = await finish_jobs(request, run, firsts)
            failed = any(r.finish_reason == 'error' for r in results)
        finally:
            lease.end(failed)
        for r in results:
            if r.finish_reason == 'error':
                raise APIError(500, f'generation failed: {r.error}', 'internal_error')
        return results

    def stream(body, run: _Run, lease: _Lease, completed: Callable[[], bool], **kw) -> _StreamResponse:
        """A streamed response; closing it (at its end, or when the client goes)
        stops the jobs and ends the lease, as failed unless ``completed()``."""
        def on_close():
            run.close()
            lease.end(failed=not completed())
        return _StreamResponse(body, on_close, **kw)

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
        n = req.n or 1
        lease = _Lease(state, req.session_id, exclusive=True)
        internal = [lease.internal_id] + [state.gateway.next_session_id() for _ in range(n - 1)]
        leader = 0 if n > 1 and _shares_prefill(state) else None
        run, firsts = await start(request, 'chat', lease, [
            _Job(i, ids, g, sid, stream=bool(req.stream), after=leader if i else None)
            for i, (g, sid) in enumerate(zip(_choices(gen, n), internal))])
        created = int(time.time())
        tt = token_text()

        def usage(results):  # the prompt once, every choice's tokens
            return _usage(max(r.input_tokens for r in results), sum(r.generated for r in results))

        if not req.stream:
            results = await collect(request, run, firsts, lease)
            return P.ChatCompletionResponse(
                id=rid, created=created, model=state.model_name,
                choices=[P.ChatCompletionChoice(
                    index=i, message=P.ChatResponseMessage(content=r.text), finish_reason=r.finish_reason,
                    logprobs=_chat_logprobs(tt, r.token_ids, r.logprobs, top_n) if req.logprobs else None)
                    for i, r in enumerate(results)],
                usage=usage(results))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: P.DeltaMessage, finish_reason=None, logprobs=None, index=0):
            return P.ChatCompletionStreamResponse(
                id=rid, created=created, model=state.model_name,
                choices=[P.ChatCompletionStreamChoice(index=index, delta=delta, finish_reason=finish_reason,
                                                      logprobs=logprobs)])

        text_chunk = _TextChunks(chunk(P.DeltaMessage(content='')), include_usage)

        async def events():
            for i in range(n):
                yield _sse(chunk(P.DeltaMessage(role='assistant', content=''), index=i), include_usage)
            results = [_Result() for _ in range(n)]
            async for i, out in run.iterate(firsts):
                _accumulate(results[i], out)
                if out.finish_reason == 'error':
                    yield _sse(error_body(500, f'generation failed: {out.error}', 'internal_error'))
                    break
                logprobs = (_chat_logprobs(tt, out.token_ids, out.logprobs, top_n)
                            if req.logprobs and out.token_ids else None)
                if logprobs is not None:
                    yield _sse(chunk(P.DeltaMessage(content=out.text), out.finish_reason, logprobs, i),
                               include_usage)
                elif out.text or out.finish_reason is not None:
                    yield text_chunk(out.text, out.finish_reason, i)
            if include_usage:
                yield _sse(P.ChatCompletionStreamResponse(id=rid, created=created, model=state.model_name,
                                                          choices=[], usage=usage(results)))
            yield 'data: [DONE]\n\n'

        return stream(events(), run, lease, lambda: True, media_type='text/event-stream', headers=_SSE_HEADERS)

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
        n = req.n or 1
        if len(prompts) * n > MAX_PROMPTS:
            raise APIError(400, f'at most {MAX_PROMPTS} choices per request (prompts x n)', 'invalid_value', 'n')
        lease = _Lease(state, req.session_id, exclusive=True)
        internal = [lease.internal_id] + [state.gateway.next_session_id() for _ in range(len(prompts) * n - 1)]
        shares = n > 1 and _shares_prefill(state)
        # choice index = prompt index * n + choice (OpenAI's order); a prompt's later choices wait for its first
        jobs = [_Job(p * n + c, ids, g, internal[p * n + c], stream=bool(req.stream),
                     after=p * n if shares and c else None)
                for p, (ids, gen) in enumerate(zip(all_ids, gens)) for c, g in enumerate(_choices(gen, n))]
        all_ids = [ids for ids in all_ids for _ in range(n)]
        prompts = [p for p in prompts for _ in range(n)]
        run, firsts = await start(request, 'completions', lease, jobs)
        created = int(time.time())
        tt = token_text()

        if not req.stream:
            results = await collect(request, run, firsts, lease)
            choices = [P.CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason,
                                          logprobs=(_completion_logprobs(tt, r.token_ids, r.logprobs, top_n)
                                                    if top_n is not None else None))
                       for i, r in enumerate(results)]
            return P.CompletionResponse(id=rid, created=created, model=state.model_name, choices=choices,
                                        usage=_usage(sum(r.input_tokens for r in results[::n]),
                                                     sum(r.generated for r in results)))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        text_chunk = _TextChunks(P.CompletionResponse(id=rid, created=created, model=state.model_name,
                                                      choices=[P.CompletionChoice(text='')]), include_usage)

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
                if logprobs is not None:
                    yield _sse(P.CompletionResponse(
                        id=rid, created=created, model=state.model_name,
                        choices=[P.CompletionChoice(index=i, text=out.text, logprobs=logprobs,
                                                    finish_reason=out.finish_reason)]), include_usage)
                elif out.text or out.finish_reason is not None:
                    yield text_chunk(out.text, out.finish_reason, i)
            if include_usage:
                yield _sse(P.CompletionResponse(id=rid, created=created, model=state.model_name, choices=[],
                                                usage=_usage(sum(r.input_tokens for r in results[::n]),
                                                             sum(r.generated for r in results))))
            yield 'data: [DONE]\n\n'

        return stream(events(), run, lease, lambda: True, media_type='text/event-stream', headers=_SSE_HEADERS)

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
        if req.max_tokens is not None and req.request_output_len not in (None, req.max_tokens):
            raise APIError(400, f'max_tokens ({req.max_tokens}) and request_output_len ({req.request_output_len}) '
                           'name the same limit: give one of them', 'invalid_value', 'max_tokens')
        max_new = _max_new_tokens(state, len(ids), req.request_output_len or req.max_tokens, check=sequence_start)
        gen = _gen_config(state, req, max_new, req.logprobs)
        rid = f'generate-{uuid.uuid4().hex}'
        log_request(rid, 'generate', prompt_for_log, ids, gen)
        lease = _Lease(state, client_id, keep=req.interactive_mode)
        client_id = lease.client_id
        run, firsts = await start(request, 'generate', lease, [
            _Job(0, ids, gen, lease.internal_id, interactive=req.interactive_mode, stream=req.stream)])

        def response(r_text, tokens, input_tokens, finish_reason, token_ids, logprobs):
            return P.GenerateResponse(
                text=r_text, tokens=tokens, input_tokens=input_tokens,
                history_tokens=max(0, input_tokens - len(ids)), finish_reason=finish_reason, session_id=client_id,
                token_ids=list(token_ids), logprobs=[{str(k): _finite(v) for k, v in lp.items()}
                                                     for lp in logprobs] if req.logprobs is not None else None)

        if not req.stream:
            r = (await collect(request, run, firsts, lease))[0]
            return response(r.text, r.generated, r.input_tokens, r.finish_reason, r.token_ids, r.logprobs)

        completed = []

        async def lines():
            async for _, out in run.iterate(firsts):
                if out.finish_reason == 'error':
                    yield json.dumps(error_body(500, f'generation failed: {out.error}', 'internal_error')) + '\n'
                    return
                yield response(out.text, out.generate_token_len, out.input_token_len, out.finish_reason,
                               out.token_ids, out.logprobs or []).model_dump_json() + '\n'
            completed.append(True)

        # a stream that does not reach its end (client gone, error) ends an interactive session
        return stream(lines(), run, lease, lambda: bool(completed), media_type='application/x-ndjson')

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
    backend_config: PytorchEngineConfig (a TurbomindEngineConfig is mapped);
        its ``engine_process`` None (default) runs the engine in a process of
        its own.
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

    from lmdeploy.log import configure
    level = log_level.upper() if isinstance(log_level, str) else log_level
    configure(level)
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
    # the engine gets a process of its own unless backend_config.engine_process says otherwise: the
    # server's threads (HTTP, JSON, detokenization) then never hold the interpreter lock its steps need
    gateway = Gateway(resolve_model_path(model_path), backend_config, chat_template_config, model_name,
                      engine_process=True)
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
        engine = gateway.engine
        logger.warning('serving %s on %s://%s:%d (KV cache: %d tokens, quant_policy %d)', state.model_name, scheme,
                       server_name, server_port, engine.num_blocks * engine.block_size, engine.quant_policy)
        # everything alive now (the app, the tokenizer, imported modules) lives as long as the server: keep it
        # out of the collector's full passes, which otherwise stall every stream for a few hundred ms now and
        # then under load (H100, 35 req/s: TTFT p99 355 ms, all of it from such stalls)
        gc.collect()
        gc.freeze()
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

    from lmdeploy.devices.registry import device_choices
    p = argparse.ArgumentParser(prog='python -m lmdeploy.serve.openai.api_server')
    p.add_argument('model_path', nargs='?', default=None)
    p.add_argument('--server-name', default='0.0.0.0')
    p.add_argument('--server-port', type=int, default=23333)
    p.add_argument('--device', default='auto', choices=device_choices())
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
    p.add_argument('--engine-process', action=argparse.BooleanOptionalAction, default=None)
    args = p.parse_args(argv)
    config = PytorchEngineConfig(device_type=args.device, session_len=args.session_len,
                                 max_batch_size=args.max_batch_size,
                                 cache_max_entry_count=args.cache_max_entry_count,
                                 num_gpu_blocks=args.num_gpu_blocks, engine_process=args.engine_process)
    return serve(args.model_path, server_name=args.server_name, server_port=args.server_port, backend_config=config,
                 chat_template_config=args.chat_template, model_name=args.model_name, api_keys=args.api_keys,
                 log_level=args.log_level, max_log_len=args.max_log_len, drain_timeout=args.drain_timeout)


if __name__ == '__main__':
    import sys
    sys.exit(main())
