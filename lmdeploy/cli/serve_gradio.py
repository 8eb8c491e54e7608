"""``lmdeploy serve gradio [MODEL | URL]``: the chat page in the browser (:mod:`lmdeploy.serve.gradio`).

MODEL (a local directory, or omitted for the embedded default model) runs the engine in this process;
``http://host:port`` puts the page in front of a running ``lmdeploy serve api_server``.
:func:`build_gradio_kwargs` maps the flags (testable without starting anything)."""
from __future__ import annotations

import argparse
from typing import Any, Dict

from .common import (add_chat_template_arg, add_engine_args, add_log_args, backend_name, build_engine_config,
                     parse_chat_template, resolve_model)


def add_gradio_parser(serve_sub) -> argparse.ArgumentParser:
    p = serve_sub.add_parser('gradio', help='chat page in the browser (Gradio)',
                             description='Serve a chat page for MODEL (a local model directory; omitted or '
                             "'default': the embedded SmolLM2-135M-Instruct), or for a running api_server "
                             "given by its URL (http://host:23333). Needs: pip install 'lmdeploy[gradio]'.")
    p.add_argument('model_path', nargs='?', default=None, metavar='MODEL_OR_URL',
                   help='local Hugging Face model directory, or the URL of a running lmdeploy api_server')
    page = p.add_argument_group('page')
    page.add_argument('--server-name', default='0.0.0.0', help='host to bind (default: %(default)s)')
    page.add_argument('--server-port', type=int, default=6006, help='port to bind (default: %(default)s)')
    page.add_argument('--api-key', default=None, help="the api_server's API key (remote mode)")
    page.add_argument('--inbrowser', action='store_true', help='open the page in the default browser')
    add_chat_template_arg(page)
    add_log_args(page, default='WARNING')
    add_engine_args(p)
    p.set_defaults(func=run_gradio)
    return p


def is_url(target) -> bool:
    return isinstance(target, str) and target.startswith(('http://', 'https://'))


def build_gradio_kwargs(args) -> Dict[str, Any]:
    """argparse namespace -> keyword arguments of :func:`lmdeploy.serve.gradio.page.run`.
    Raises ValueError / FileNotFoundError for invalid values."""
    if not 0 <= args.server_port <= 65535:
        raise ValueError(f'--server-port must be in [0, 65535], got {args.server_port}')
    kw = dict(server_name=args.server_name, server_port=args.server_port, inbrowser=bool(args.inbrowser))
    if is_url(args.model_path):  # the engine flags belong to the api_server then
        return dict(kw, target=args.model_path.rstrip('/'), api_key=args.api_key)
    backend_name(args)
    return dict(kw, target=resolve_model(args.model_path), backend_config=build_engine_config(args),
                chat_template_config=parse_chat_template(args.chat_template))


def run_gradio(args) -> int:
    kwargs = build_gradio_kwargs(args)
    from lmdeploy.log import configure
    configure(args.log_level.upper())
    try:
        import gradio  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"cannot start the chat page: {e}; install it: pip install 'lmdeploy[gradio]'") from e
    from lmdeploy.serve.gradio.page import run
    run(block=True, **kwargs)
    return 0
