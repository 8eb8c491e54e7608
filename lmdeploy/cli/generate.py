"""``lmdeploy generate [PROMPT ...]``: answer prompts (the chat template applied), print the answers, exit.

Greedy by default; ``--temperature`` above 0 samples. The engine flags are the other commands'
(``--session-len``, ``--quant-policy``, ``--device``, ...). A prompt the engine refuses (longer than
``--session-len``, say) gets ``error: <why>`` on stderr instead of an answer, and the exit status is 2.
"""
from __future__ import annotations

import argparse
import sys

from .common import (add_chat_template_arg, add_engine_args, add_log_args, backend_name, build_engine_config,
                     parse_chat_template)

SAMPLE_PROMPT = 'What is the capital of France?'


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser('generate', help='answer prompts and exit (chat template applied)', description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('prompt', nargs='*', help=f'prompts (default: {SAMPLE_PROMPT!r})')
    p.add_argument('--model', default=None,
                   help="local Hugging Face model directory; omitted or 'default': the embedded SmolLM2-135M-Instruct")
    add_chat_template_arg(p)
    add_log_args(p)
    g = p.add_argument_group('generation')
    g.add_argument('--max-new-tokens', type=int, default=128, help='most tokens per answer (default: %(default)s)')
    g.add_argument('--temperature', type=float, default=0.0,
                   help='sampling temperature; 0 decodes greedily (default: %(default)s)')
    g.add_argument('--top-p', type=float, default=1.0, help='nucleus sampling mass (default: %(default)s)')
    g.add_argument('--stream', action='store_true', help='print text as it is generated')
    add_engine_args(p)
    p.set_defaults(func=run_generate)
    return p


def build_gen_config(args):
    """The generation flags -> GenerationConfig (invalid values raise ValueError naming the field)."""
    from lmdeploy.messages import GenerationConfig
    return GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                            temperature=args.temperature, top_p=args.top_p)


def run_generate(args, stdout=None, stderr=None) -> int:
    out, err = stdout or sys.stdout, stderr or sys.stderr
    gen = build_gen_config(args)
    backend_name(args)
    backend_config = build_engine_config(args)
    chat_template_config = parse_chat_template(args.chat_template)
    prompts = args.prompt or [SAMPLE_PROMPT]
    from lmdeploy import RequestError, pipeline
    with pipeline(args.model, backend_config=backend_config, chat_template_config=chat_template_config,
                  log_level=args.log_level) as pipe:
        status = 0
        if not args.stream:
            try:
                results = pipe(prompts, gen)
            except RequestError as e:  # the answers of the other prompts ride on it
                results, status = e.responses, 2
            for prompt, resp in zip(prompts, results):
                print(f'>>> {prompt}', file=out, flush=True)
                if resp.refused:
                    print(f'error: {resp.error}', file=err, flush=True)
                else:
                    print(resp.text, file=out, flush=True)
            return status
        for prompt in prompts:
            print(f'>>> {prompt}', file=out, flush=True)
            error, wrote = None, False
            for piece in pipe.stream_infer(prompt, gen):
                out.write(piece.text)
                out.flush()
                wrote = wrote or bool(piece.text)
                if piece.refused:
                    error = piece.error
            if wrote or not error:
                print(file=out, flush=True)
            if error:
                print(f'error: {error}', file=err, flush=True)
                status = 2
        return status
