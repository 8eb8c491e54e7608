"""``lmdeploy serve api_server [MODEL]``: the OpenAI-compatible HTTP server.

The flags (:func:`add_api_server_args`) are turned into the keyword arguments of
``lmdeploy.serve.openai.api_server.serve`` by :func:`build_serve_kwargs`,
which is testable without starting a server. ``python -m lmdeploy.serve.openai.api_server``
parses the same flags (:func:`module_parser`) and runs them the same way (:func:`run_api_server`).
"""
from __future__ import annotations

import argparse
from typing import Any, Dict

from .common import (Parser, add_chat_template_arg, add_engine_args, add_log_args, add_model_arg, backend_name,
                     build_engine_config, parse_chat_template, resolve_model)
from .serve_gradio import add_gradio_parser


def add_parser(sub) -> argparse.ArgumentParser:
    serve = sub.add_parser('serve', help='serve a model over HTTP',
                           description='Serve a model. Subcommands: api_server (OpenAI-compatible REST API), '
                           'proxy (one address in front of several api_servers), gradio (chat page in the browser).')
    serve_sub = serve.add_subparsers(dest='serve_command', metavar='{api_server,proxy,gradio}')
    p = serve_sub.add_parser('api_server', help='OpenAI-compatible REST API server',
                             description='Serve MODEL with an OpenAI-compatible REST API '
                             '(/v1/models, /v1/chat/completions, /v1/completions, ...).')
    add_api_server_args(p)
    p.set_defaults(func=run_api_server)
    from .proxy import add_proxy_parser
    add_proxy_parser(serve_sub)
    add_gradio_parser(serve_sub)
    serve.set_defaults(func=lambda args: _serve_help(serve))
    return serve


def add_api_server_args(p: argparse.ArgumentParser):
    """The flags of ``lmdeploy serve api_server``: MODEL, the server group, the engine flags, the proxy link.
    ``python -m lmdeploy.serve.openai.api_server`` builds its parser with it too (see :func:`module_parser`)."""
    add_model_arg(p)
    http = p.add_argument_group('server')
    http.add_argument('--server-name', default='0.0.0.0', help='host to bind (default: %(default)s)')
    http.add_argument('--server-port', type=int, default=23333, help='port to bind (default: %(default)s)')
    http.add_argument('--allow-origins', nargs='+', default=['*'], help='CORS allowed origins (default: %(default)s)')
    http.add_argument('--allow-credentials', action='store_true', help='CORS: allow credentials')
    http.add_argument('--allow-methods', nargs='+', default=['*'], help='CORS allowed methods (default: %(default)s)')
    http.add_argument('--allow-headers', nargs='+', default=['*'], help='CORS allowed headers (default: %(default)s)')
    http.add_argument('--api-keys', nargs='+', default=None,
                      help='accepted API keys (Authorization: Bearer KEY); default: no authentication')
    http.add_argument('--ssl', action='store_true',
                      help='serve HTTPS with the key and certificate in $SSL_KEYFILE and $SSL_CERTFILE')
    http.add_argument('--model-name', default=None,
                      help='model name the API reports and accepts (default: the model directory name)')
    add_chat_template_arg(http)
    http.add_argument('--tool-call-parser', default='auto', choices=tool_parser_choices(),
                      help='how the model writes tool calls (default: auto, from its chat template and type)')
    add_log_args(http, default='WARNING')
    http.add_argument('--max-log-len', type=int, default=None,
                      help='characters of prompts / token ids to log per request (default: all)')
    add_engine_args(p)
    add_proxy_link_args(p)


def module_parser(drain_timeout: float) -> argparse.ArgumentParser:
    """The parser of ``python -m lmdeploy.serve.openai.api_server``: ``lmdeploy serve api_server``'s flags, and
    two of the module's own (``--num-gpu-blocks``, read by :func:`build_engine_config`; ``--drain-timeout``,
    a keyword of ``serve()`` from :func:`build_serve_kwargs`). Run it with :func:`run_api_server`."""
    p = Parser(prog='python -m lmdeploy.serve.openai.api_server',
               description='Serve MODEL with an OpenAI-compatible REST API (lmdeploy serve api_server).')
    add_api_server_args(p)
    g = p.add_argument_group('this module only')
    g.add_argument('--num-gpu-blocks', type=int, default=0,
                   help='KV cache blocks to allocate: if > 0, exactly this many (overrides --cache-max-entry-count) '
                   '(default: %(default)s)')
    g.add_argument('--drain-timeout', type=float, default=drain_timeout,
                   help='seconds running requests get after SIGTERM before they are cut short (default: '
                   '%(default)s)')
    return p


def add_proxy_link_args(p):
    g = p.add_argument_group('proxy (lmdeploy serve proxy)')
    g.add_argument('--proxy-url', default=None,
                   help='register with this proxy once listening, e.g. http://HOST:8000, and again every 30 s while '
                   'serving (so a restarted proxy has it back); leave it on shutdown')
    g.add_argument('--proxy-api-key', default=None,
                   help="the proxy's API key for registering (default: $LMDEPLOY_PROXY_API_KEY)")
    g.add_argument('--node-url', default=None,
                   help='the URL the proxy reaches this server at (default: from --server-name/--server-port; '
                   "0.0.0.0 becomes this machine's address towards the proxy)")


def tool_parser_choices():
    from lmdeploy.frontend.tool_calls.formats import ALIASES, FORMATS
    return ['auto'] + sorted(FORMATS) + sorted(ALIASES)


def _serve_help(parser) -> int:
    parser.print_help()
    return 1


def build_serve_kwargs(args) -> Dict[str, Any]:
    """argparse namespace -> keyword arguments of ``serve()``, including
    ``model_path`` (the embedded default model when MODEL was omitted).

    Raises ValueError / FileNotFoundError for invalid values."""
    if args.server_port is not None and not 0 <= args.server_port <= 65535:
        raise ValueError(f'--server-port must be in [0, 65535], got {args.server_port}')
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f'--max-log-len must be >= 0, got {args.max_log_len}')
    backend = backend_name(args)
    backend_config = build_engine_config(args)
    chat_template_config = parse_chat_template(args.chat_template)
    return dict(model_path=resolve_model(args.model_path),
                server_name=args.server_name,
                server_port=args.server_port,
                backend=backend,
                backend_config=backend_config,
                chat_template_config=chat_template_config,
                model_name=args.model_name,
                api_keys=list(args.api_keys) if args.api_keys else None,
                ssl=bool(args.ssl),
                allow_origins=list(args.allow_origins),
                allow_credentials=bool(args.allow_credentials),
                allow_methods=list(args.allow_methods),
                allow_headers=list(args.allow_headers),
                log_level=args.log_level,
                max_log_len=args.max_log_len,
                tool_call_parser=getattr(args, 'tool_call_parser', None),
                **proxy_link_kwargs(args), **drain_kwargs(args))


def drain_kwargs(args) -> Dict[str, Any]:
    """``--drain-timeout`` (``python -m lmdeploy.serve.openai.api_server`` only) -> ``serve()``'s keyword."""
    return {'drain_timeout': args.drain_timeout} if hasattr(args, 'drain_timeout') else {}


def proxy_link_kwargs(args) -> Dict[str, Any]:
    """``--proxy-url`` and its companions -> ``serve()``'s keyword arguments (none without a proxy)."""
    url = getattr(args, 'proxy_url', None)
    if not url:
        return {}
    if not url.startswith(('http://', 'https://')):
        raise ValueError(f'--proxy-url must be http(s)://HOST:PORT, got {url!r}')
    return dict(proxy_url=url, proxy_api_key=args.proxy_api_key, node_url=args.node_url)


def run_api_server(args) -> int:
    kwargs = build_serve_kwargs(args)
    try:
        from lmdeploy.serve.openai.api_server import serve
    except ImportError as e:
        missing = getattr(e, 'name', None)
        hint = ("; install the server's dependencies: pip install 'lmdeploy[serve]'"
                if missing and not missing.startswith('lmdeploy') else '')
        raise RuntimeError(f'cannot start the API server: {e}{hint}') from e
    model_path = kwargs.pop('model_path')
    result = serve(model_path, **kwargs)
    return result if isinstance(result, int) else 0
