"""``lmdeploy`` command line.

    lmdeploy serve api_server [MODEL] [--server-port 23333] [--device auto] ...   OpenAI-compatible server
    lmdeploy serve proxy [--server-port 8000] [--strategy min_expected_latency]   one address, several servers
    lmdeploy serve gradio [MODEL | URL] [--server-port 6006] ...                   chat page in the browser
    lmdeploy chat [MODEL] [--device auto] [--temperature T] ...                    interactive terminal chat
    lmdeploy generate [PROMPT ...] [--model PATH] [--device cpu] [--max-new-tokens N]
    lmdeploy check_env                                                             environment + op self-test
    lmdeploy list                                                                  builtin chat templates
    lmdeploy --version

MODEL is a local Hugging Face directory; omitted, the embedded default model
(SmolLM2-135M-Instruct) is used. Subcommand modules: :mod:`.serve`,
:mod:`.chat`, :mod:`.check_env`, :mod:`.proxy`; :mod:`.common` holds the flags they share.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _generate(args) -> int:
    from lmdeploy import GenerationConfig, PytorchEngineConfig, RequestError, pipeline
    backend = PytorchEngineConfig(device_type=args.device, dtype=args.dtype)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                           temperature=args.temperature, top_p=args.top_p)
    prompts = args.prompt or ['What is the capital of France?']
    with pipeline(args.model, backend_config=backend) as pipe:
        if args.stream:
            for i, prompt in enumerate(prompts):
                print(f'>>> {prompt}')
                for piece in pipe.stream_infer(prompt, gen):
                    print(piece.text, end='', flush=True)
                print()
        else:
            try:
                results = pipe(prompts, gen)
            except RequestError as e:
                print(f'error: {e}', file=sys.stderr)
                return 2
            for prompt, resp in zip(prompts, results):
                print(f'>>> {prompt}\n{resp.text}')
    return 0


def _list(args) -> int:
    from lmdeploy.frontend.chat_template import list_builtin_templates
    for name in list_builtin_templates():
        print(name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import chat as cli_chat
    from . import check_env
    from . import serve as cli_serve
    from lmdeploy.devices.registry import device_choices
    from lmdeploy.version import __version__
    parser = argparse.ArgumentParser(prog='lmdeploy', description='Serve large language models fast.')
    parser.add_argument('--version', action='version', version=__version__)
    sub = parser.add_subparsers(dest='command', metavar='{serve,chat,generate,check_env,list}')
    cli_serve.add_parser(sub)
    cli_chat.add_parser(sub)
    gen = sub.add_parser('generate', help='generate answers to prompts (chat template applied)')
    gen.add_argument('prompt', nargs='*', help='prompts (default: a sample question)')
    gen.add_argument('--model', default=None, help='local HF model directory (default: embedded SmolLM2-135M)')
    gen.add_argument('--device', default='auto', choices=device_choices())
    gen.add_argument('--dtype', default='auto', choices=['auto', 'float16', 'bfloat16', 'float32'])
    gen.add_argument('--max-new-tokens', type=int, default=128)
    gen.add_argument('--temperature', type=float, default=0.0, help='0 decodes greedily')
    gen.add_argument('--top-p', type=float, default=1.0)
    gen.add_argument('--stream', action='store_true', help='print text as it is generated')
    gen.set_defaults(func=_generate)
    check_env.add_parser(sub)
    lst = sub.add_parser('list', help='list the builtin chat template names')
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
