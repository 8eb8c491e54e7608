"""The OpenAI-compatible REST server: ``lmdeploy serve api_server MODEL``.

Endpoints:

* ``GET  /v1/models``, ``GET /v1/models/{model_id}``
* ``POST /v1/chat/completions`` (SSE streaming, ending with ``data: [DONE]``)
* ``POST /v1/completions``
* ``POST /generate`` - LMDeploy's native API: interactive sessions, streaming
  as newline-delimited JSON
* ``GET  /health`` (200 when ready, 503 while loading or shutting down)
* ``GET  /metrics`` (Prometheus; see :mod:`lmdeploy.serve.openai.metrics`)

Each endpoint family has its module (:mod:`.chat`, :mod:`.completions`,
:mod:`.generate`); they check a request, build its jobs and hand them to one
:class:`~.runner.Runner`, which starts them, collects or streams their outputs
and ends the session lease.

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
away cancels its requests; SIGTERM / SIGINT drain: new requests and /health
get 503, running ones finish (up to ``drain_timeout``, or a second signal:
then they end with an error event), then :func:`serve` returns 0. The port is
bound before the model loads, and "serving" logged once it listens.

Run it with ``lmdeploy serve api_server MODEL [flags]``, from Python with
:func:`serve`, or as ``python -m lmdeploy.serve.openai.api_server MODEL
[flags]`` (the same flags, parsed and built by :mod:`lmdeploy.cli.serve`, plus
``--num-gpu-blocks`` and ``--drain-timeout``).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import List, Optional, Sequence, Union

from fastapi import FastAPI, Path, Security
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from fastapi.security import HTTPBearer

from lmdeploy.messages import PytorchEngineConfig, TurbomindEngineConfig

from . import chat, completions, generate
from . import protocol as P
from .errors import APIError, error_response, install_error_handlers
from .guard import DEFAULT_MAX_BODY_BYTES, GuardMiddleware
from .metrics import CONTENT_TYPE_LATEST
from .params import check_model
from .runner import Runner
from .schema import SERVED_MODEL, install_schema
from .state import ServerState
from .uvicorn_server import BackgroundServer, bind_socket, make_server_class

logger = logging.getLogger('lmdeploy.serve')

__all__ = ['create_app', 'serve', 'BackgroundServer', 'APIError', 'DEFAULT_MAX_BODY_BYTES', 'main']

DEFAULT_DRAIN_TIMEOUT = 60


# ------------------------------------------------------------------------ app
def create_app(gateway=None, *, api_keys: Optional[Sequence[str]] = None, model_name: Optional[str] = None,
               allow_origins: Sequence[str] = ('*', ), allow_credentials: bool = False,
               allow_methods: Sequence[str] = ('*', ), allow_headers: Sequence[str] = ('*', ),
               max_log_len: Optional[int] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               tool_call_parser: Optional[str] = None) -> FastAPI:
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
    tool_call_parser: how the model writes tool calls ('qwen', 'llama3',
        'internlm2'); None or 'auto': detected from its chat template and type.
    """
    if tool_call_parser not in (None, 'auto'):
        from lmdeploy.frontend.tool_calls import get_format
        get_format(tool_call_parser)  # an unknown name fails here, not at the first request
    state = ServerState(gateway, model_name, api_keys, max_log_len, tool_call_parser)
    app = FastAPI(title='lmdeploy API server', version=_version(),
                  description='OpenAI-compatible REST API of lmdeploy (plus the native /generate).')
    app.state.lmdeploy = state
    bearer = HTTPBearer(auto_error=False, description='one of the server\'s --api-keys')
    auth = [Security(bearer)] if api_keys else []
    # 500: the engine failed (never a request's fault)
    err = {status: {'model': P.ErrorResponse} for status in (400, 401, 404, 413, 500, 503)}
    install_error_handlers(app)
    _add_simple_routes(app, state, auth, err)
    app.state.runner = Runner(state)  # what the handlers run requests on (their dependency: request_runner)
    for family in (chat, completions, generate):
        family.add_routes(app, auth, err)
    install_schema(app, state)  # the loaded model's name and vocabulary in the schema
    app.add_middleware(GuardMiddleware, state=state, max_body_bytes=max_body_bytes)
    app.add_middleware(CORSMiddleware, allow_origins=list(allow_origins), allow_credentials=allow_credentials,
                       allow_methods=list(allow_methods), allow_headers=list(allow_headers))
    return app


def _add_simple_routes(app: FastAPI, state: ServerState, auth, err):

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

    created = int(time.time())

    def card() -> P.ModelCard:
        return P.ModelCard(id=state.model_name, created=created, root=state.model_name,
                           max_model_len=state.gateway.session_len)

    @app.get('/v1/models', response_model=P.ModelList, dependencies=auth, responses=err)
    async def list_models():
        return P.ModelList(data=[card()])

    # (':path': a served name may hold slashes, "org/model")
    @app.get('/v1/models/{model_id:path}', response_model=P.ModelCard, dependencies=auth, responses=err)
    async def retrieve_model(model_id: str = Path(description='the served model name (any other: 404 '
                                                  'model_not_found)', json_schema_extra={SERVED_MODEL: True})):
        """The model as ``GET /v1/models`` lists it."""
        check_model(state, model_id)
        return card()


def _version() -> str:
    from lmdeploy.version import __version__
    return __version__


def serve(model_path: Optional[str] = None, *, server_name: str = '0.0.0.0', server_port: int = 23333,
          backend: str = 'pytorch', backend_config: Union[PytorchEngineConfig, TurbomindEngineConfig, None] = None,
          chat_template_config=None, model_name: Optional[str] = None, api_keys: Optional[Sequence[str]] = None,
          ssl: bool = False, allow_origins: Sequence[str] = ('*', ), allow_credentials: bool = False,
          allow_methods: Sequence[str] = ('*', ), allow_headers: Sequence[str] = ('*', ),
          log_level: str = 'WARNING', max_log_len: Optional[int] = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, drain_timeout: Optional[float] = DEFAULT_DRAIN_TIMEOUT,
          tool_call_parser: Optional[str] = None, proxy_url: Optional[str] = None,
          proxy_api_key: Optional[str] = None, node_url: Optional[str] = None) -> int:
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
        are cut short (a stream ends with an error event, then ``[DONE]``);
        None: wait for them however long (a second signal cuts them).
    tool_call_parser: how the model writes tool calls ('qwen', 'llama3',
        'internlm2'); None or 'auto': detected.
    proxy_url: a ``lmdeploy serve proxy`` to register with once listening (and
        to leave when draining); failing to register is a warning, not an error.
    proxy_api_key: the proxy's API key (default: $LMDEPLOY_PROXY_API_KEY).
    node_url: the URL the proxy reaches this server at (default: from
        server_name and server_port; a wildcard host becomes this machine's
        address towards the proxy).
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
    from lmdeploy.cli.common import chat_template_config as read_chat_template
    chat_template_config = read_chat_template(chat_template_config)
    # the port first: one in use fails now, not after the model has loaded
    sock = bind_socket(server_name, server_port)
    try:
        # the engine gets a process of its own unless backend_config.engine_process says otherwise: the
        # server's threads (HTTP, JSON, detokenization) then never hold the interpreter lock its steps need
        gateway = Gateway(resolve_model_path(model_path), backend_config, chat_template_config, model_name,
                          engine_process=True)
    except BaseException:
        sock.close()
        raise
    try:
        app = create_app(gateway, api_keys=api_keys, model_name=model_name, allow_origins=allow_origins,
                         allow_credentials=allow_credentials, allow_methods=allow_methods,
                         allow_headers=allow_headers, max_log_len=max_log_len, max_body_bytes=max_body_bytes,
                         tool_call_parser=tool_call_parser)
        state: ServerState = app.state.lmdeploy
        uv_level = logging.getLevelName(level).lower() if isinstance(level, int) else level.lower()
        if uv_level not in ('critical', 'error', 'warning', 'info', 'debug', 'trace'):
            uv_level = 'warning'
        config = uvicorn.Config(app, host=server_name, port=server_port, log_level=uv_level, lifespan='off',
                                timeout_graceful_shutdown=drain_timeout, **ssl_kwargs)
        scheme = 'https' if ssl else 'http'
        link = _proxy_link(proxy_url, proxy_api_key, node_url, server_name, server_port, scheme, state.model_name,
                           getattr(gateway.engine, 'max_batch_size', None))

        def on_exit():
            state.draining = True
            if link is not None:  # the proxy stops sending new requests while the running ones finish
                link.deregister_in_background()

        engine = gateway.engine

        def on_listening(_server):
            logger.warning('serving %s on %s://%s:%d (KV cache: %d tokens, quant_policy %d)', state.model_name,
                           scheme, server_name, sock.getsockname()[1], engine.num_blocks * engine.block_size,
                           engine.quant_policy)

        # SIGTERM / SIGINT: /health and new requests answer 503 while the running ones finish (a second signal
        # or drain_timeout ends them, each response still well-formed), then serve() returns 0
        server = make_server_class()(config, on_exit=on_exit, on_cut=state.cut_running, on_listening=on_listening)
        # everything alive now (the app, the tokenizer, imported modules) lives as long as the server: keep it
        # out of the collector's full passes, which otherwise stall every stream for a few hundred ms now and
        # then under load (H100, 35 req/s: TTFT p99 355 ms, all of it from such stalls)
        gc.collect()
        gc.freeze()
        if link is not None:
            link.register_when_listening(server)
        try:
            server.run(sockets=[sock])
        finally:
            if link is not None:
                link.leave()
        if not server.started:
            return 1
        logger.warning('drained; bye')
        return 0
    finally:
        sock.close()
        gateway.close()


def _proxy_link(proxy_url, api_key, node_url, server_name, server_port, scheme, model_name, max_batch_size=None):
    if not proxy_url:
        return None
    from lmdeploy.serve.proxy.register import ProxyLink, own_url
    return ProxyLink(proxy_url, node_url or own_url(server_name, server_port, proxy_url, scheme), [model_name],
                     api_key, max_batch_size=max_batch_size)


# ----------------------------------------------------------------- __main__
def main(argv: Optional[List[str]] = None) -> int:
    """``python -m lmdeploy.serve.openai.api_server MODEL [flags]``: ``lmdeploy serve api_server``'s flags
    (its parser and builders, :mod:`lmdeploy.cli.serve`) plus ``--num-gpu-blocks`` and ``--drain-timeout``."""
    from lmdeploy.cli.serve import module_parser, run_api_server
    return run_api_server(module_parser(DEFAULT_DRAIN_TIMEOUT).parse_args(argv))


if __name__ == '__main__':
    import sys
    sys.exit(main())
