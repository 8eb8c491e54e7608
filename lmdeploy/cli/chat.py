"""``lmdeploy chat [MODEL]``: an interactive chat in the terminal.

Every turn continues one engine session (its KV cache stays between turns,
so only the new turn is prefilled). After each answer a status line shows
the session's token counts::

    [session 1 | turn 2 | prompt 57 tokens | reply 12 tokens | context 69/8192 tokens]

``prompt`` is the whole context the turn was generated from (earlier turns
included), ``reply`` the tokens of the answer, ``context`` their sum (the
session also keeps the stop token that ended the answer).

Commands at the ``>>>`` prompt: ``exit`` (or ``quit``, or Ctrl-D) ends the
session and quits; ``reset`` starts a new session. Ctrl-C while an answer is
being generated stops that answer (the part already shown stays in the
session) and returns to the prompt.

Sampling: greedy by default. ``--do-sample``, or any ``--temperature``
above 0, samples; ``--temperature 0`` always decodes greedily. ``--top-p``,
``--top-k`` and ``--min-p`` only matter when sampling; ``--seed`` makes
sampling reproducible.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Optional

from .common import (add_chat_template_arg, add_engine_args, add_log_args, add_model_arg, backend_name,
                         build_engine_config, gen_defaults, parse_chat_template, resolve_model)

PROMPT = '>>> '
EXIT_WORDS = ('exit', 'quit', 'exit()', 'quit()')
RESET_WORDS = ('reset', 'clear')


def add_parser(sub) -> argparse.ArgumentParser:
    d = gen_defaults()
    p = sub.add_parser('chat', help='chat with a model in the terminal',
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(p)
    add_chat_template_arg(p)
    p.add_argument('--system', default=None, help='system prompt of each session')
    add_log_args(p, default='ERROR')
    g = p.add_argument_group('generation')
    g.add_argument('--max-new-tokens', type=int, default=d['max_new_tokens'],
                   help='most tokens per answer (default: %(default)s)')
    g.add_argument('--do-sample', action='store_true',
                   help='sample instead of greedy decoding (implied by --temperature > 0)')
    g.add_argument('--temperature', type=float, default=None,
                   help=f'sampling temperature; > 0 turns sampling on, 0 forces greedy decoding '
                   f'(default with --do-sample: {d["temperature"]})')
    g.add_argument('--top-p', type=float, default=d['top_p'], help='nucleus sampling mass (default: %(default)s)')
    g.add_argument('--top-k', type=int, default=d['top_k'],
                   help='sample among the k most likely tokens, 0 disables (default: %(default)s)')
    g.add_argument('--min-p', type=float, default=d['min_p'], help='min-p filter (default: %(default)s)')
    g.add_argument('--repetition-penalty', type=float, default=d['repetition_penalty'],
                   help='repetition penalty, 1 disables (default: %(default)s)')
    g.add_argument('--seed', type=int, default=None, help='random seed for reproducible sampling')
    g.add_argument('--ignore-eos', action='store_true', help=argparse.SUPPRESS)
    add_engine_args(p)
    p.set_defaults(func=run_chat)
    return p


def build_gen_config(args):
    """Sampling flags -> GenerationConfig (see the module docstring for the rules)."""
    from lmdeploy.messages import GenerationConfig
    d = gen_defaults()
    temperature = d['temperature'] if args.temperature is None else args.temperature
    do_sample = bool(args.do_sample) or (args.temperature is not None and args.temperature > 0)
    return GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=do_sample, temperature=temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, random_seed=args.seed,
                            ignore_eos=bool(args.ignore_eos))


class _Interrupt:
    """While an answer streams, Ctrl-C cancels it instead of raising."""

    def __init__(self, cancel):
        self.cancel = cancel
        self.hit = False
        self._old = None

    def _handler(self, signum, frame):
        if not self.hit:
            self.hit = True
            self.cancel()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _read(prompt: str) -> Optional[str]:
    """One line from the user; None at EOF."""
    try:
        return input(prompt)
    except EOFError:
        return None


def run_chat(args, stdout=None) -> int:
    out = stdout or sys.stdout
    gen = build_gen_config(args)
    backend_name(args)
    backend_config = build_engine_config(args)
    chat_template_config = parse_chat_template(args.chat_template)
    model_path = resolve_model(args.model_path)
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass

    from lmdeploy.api import pipeline
    from lmdeploy.frontend.pipeline import Session

    pipe = pipeline(model_path, backend_config=backend_config, chat_template_config=chat_template_config,
                    log_level=args.log_level)
    try:
        device_name = pipe.engine.device_name  # (EngineLike: in-process and engine-process alike)
        session_len = getattr(pipe.gateway, 'session_len', None)

        def cancel(session_id):
            canceller = getattr(pipe, 'cancel', None) or pipe.gateway.cancel
            canceller(session_id)

        print(f'lmdeploy chat: {model_path} on {device_name}; session_len {session_len}.\n'
              f"Type 'exit' (or Ctrl-D) to quit, 'reset' to start a new session; "
              f'Ctrl-C stops an answer.', file=out, flush=True)
        session = Session(pipe.gateway.next_session_id())
        while True:
            try:
                line = _read(PROMPT)
            except KeyboardInterrupt:
                print("\n(Ctrl-C: type 'exit' or press Ctrl-D to quit)", file=out, flush=True)
                continue
            if line is None:
                print(file=out, flush=True)
                break
            text = line.strip()
            if not text:
                continue
            if text.lower() in EXIT_WORDS:
                break
            if text.lower() in RESET_WORDS:
                pipe.end_session(session)
                session = Session(pipe.gateway.next_session_id())
                print(f'[new session {session.session_id}]', file=out, flush=True)
                continue
            prompt = text
            if args.system and session.step == 0:
                prompt = [{'role': 'system', 'content': args.system}, {'role': 'user', 'content': text}]
            if not _turn(pipe, session, prompt, gen, session_len, cancel, out):
                pipe.end_session(session)
                session = Session(pipe.gateway.next_session_id())
                print(f'[the session is full; new session {session.session_id}]', file=out, flush=True)
        pipe.end_session(session)
    finally:
        pipe.close()
    return 0


def _turn(pipe, session, prompt, gen, session_len, cancel, out) -> bool:
    """Stream one answer; False when the session cannot go on (full)."""
    last = None
    error = None
    with _Interrupt(lambda: cancel(session.session_id)) as intr:
        for piece in pipe.chat(prompt, session=session, gen_config=gen, stream_response=True):
            if piece.text:
                out.write(piece.text)
                out.flush()
            if piece.error:
                error = piece.error
            last = piece
    out.write('\n')
    if intr.hit:
        out.write('[stopped]\n')
    if error:
        out.write(f'[error: {error}]\n')
        out.flush()
        # full: the answer ran to session_len ('length'), or the turn no longer fits (refused, 'error')
        full = last is not None and (last.finish_reason == 'length' or
                                     bool(session_len) and last.input_token_len >= session_len)
        return not full
    if last is not None:
        prompt_len = last.input_token_len
        reply_len = last.generate_token_len
        context = prompt_len + reply_len
        limit = f'/{session_len}' if session_len else ''
        reason = f' | {last.finish_reason}' if last.finish_reason not in (None, 'stop') else ''
        out.write(f'[session {session.session_id} | turn {session.step} | prompt {prompt_len} tokens | '
                  f'reply {reply_len} tokens | context {context}{limit} tokens{reason}]\n')
    out.flush()
    return True
