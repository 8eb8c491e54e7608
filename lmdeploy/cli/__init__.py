"""``lmdeploy`` command line.

    lmdeploy serve api_server [MODEL] [--server-port 23333] [--device auto] ...   OpenAI-compatible server
    lmdeploy serve proxy [--server-port 8000] [--strategy min_expected_latency]   one address, several servers
    lmdeploy serve gradio [MODEL | URL] [--server-port 6006] ...                   chat page in the browser
    lmdeploy chat [MODEL] [--device auto] [--temperature T] ...                    interactive terminal chat
    lmdeploy generate [PROMPT ...] [--model MODEL] [--session-len N] [--max-new-tokens N] ...  answer and exit
    lmdeploy lite auto_awq MODEL --work-dir OUT [--w-group-size 128] ...         AWQ 4-bit weights, offline
    lmdeploy check_env                                                             environment + op self-test
    lmdeploy list                                                                  architectures, chat templates
    lmdeploy --version

MODEL is a local Hugging Face directory; omitted, the embedded default model
(SmolLM2-135M-Instruct) is used. Subcommand modules: :mod:`.serve`,
:mod:`.chat`, :mod:`.generate`, :mod:`.lite`, :mod:`.check_env`, :mod:`.proxy`; :mod:`.common` holds the flags they
share and the parser class (no abbreviated flags; a subcommand reports its own usage).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _list(args) -> int:
    """What this build runs: the model registry's architectures (config.json's ``architectures``, the name a
    checkpoint is loaded by) and the built-in chat template names ``--chat-template`` takes."""
    from lmdeploy.engine.models import ARCHITECTURES
    from lmdeploy.frontend.chat_template import list_builtin_templates
    print('Supported architectures (config.json "architectures"):')
    for name in sorted(ARCHITECTURES):
        print(f'  {name}')
    print('Built-in chat templates (--chat-template NAME; used where a checkpoint has no template of its own):')
    for name in list_builtin_templates():
        print(f'  {name}')
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import chat as cli_chat
    from . import check_env
    from . import generate as cli_generate
    from . import lite as cli_lite
    from . import serve as cli_serve
    from .common import Parser
    from lmdeploy.version import __version__
    parser = Parser(prog='lmdeploy', description='Serve large language models fast.')
    parser.add_argument('--version', action='version', version=__version__)
    sub = parser.add_subparsers(dest='command', metavar='{serve,chat,generate,lite,check_env,list}')
    cli_serve.add_parser(sub)
    cli_chat.add_parser(sub)
    cli_generate.add_parser(sub)
    cli_lite.add_parser(sub)
    check_env.add_parser(sub)
    lst = sub.add_parser('list', help='list the supported architectures and the builtin chat template names')
    lst.set_defaults(func=_list)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, 'func', None):
        parser.print_help()
        return 1
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError, NotImplementedError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == '__main__':
    sys.exit(main())
