"""``POST /v1/completions``: OpenAI's text completions (several prompts, n choices each, logprobs).

:func:`completions` is the handler (:func:`add_routes` registers it): it checks the request (:func:`_prompts`,
:func:`_generation_configs`), starts a job per choice on the :class:`~.runner.Runner`, then answers at once
(:func:`_response`) or streams (:class:`_CompletionStream`).
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import List

from fastapi import Depends, FastAPI, Request

from lmdeploy.engine.grammar import spec_from_response_format

from . import protocol as P
from .errors import APIError, error_body
from .guard import request_owner
from .jobs import SSE_HEADERS, Job, Result, TextChunks, accumulate, sse
from .params import (COMPLETION_MAX_TOKENS, MAX_PROMPTS, check_ids, check_model, check_unsupported, choice_configs,
                     compile_grammar, completion_logprobs, encode, gen_config, max_new_tokens, usage_info)
from .runner import Runner, request_runner
from .sessions import Lease
from .state import ServerState


def add_routes(app: FastAPI, auth, err):
    """Register ``POST /v1/completions`` (the handler gets the app's Runner from :func:`request_runner`)."""
    app.post('/v1/completions', response_model=P.CompletionResponse, dependencies=auth,
             responses={**err, 200: {'content': {'text/event-stream': {}}}})(completions)


async def completions(req: P.CompletionRequest, request: Request, runner: Runner = Depends(request_runner)):
    state = runner.state
    check_model(state, req.model)
    check_unsupported(req)
    if req.suffix:
        raise APIError(400, 'suffix is not supported', 'unsupported_parameter', 'suffix')
    if req.best_of not in (None, 1):
        raise APIError(400, 'best_of is not supported: only 1', 'unsupported_parameter', 'best_of')
    prompts = _prompts(req)
    all_ids = [check_ids(state, p, 'prompt') if isinstance(p, list) else encode(state, p, do_preprocess=False)
               for p in prompts]
    gens = await _generation_configs(state, req, all_ids)
    rid = f'cmpl-{uuid.uuid4().hex}'
    for p, ids, gen in zip(prompts, all_ids, gens):
        runner.log_request(rid, 'completion', p if isinstance(p, str) else str(p), ids, gen)
    n = req.n or 1
    if len(prompts) * n > MAX_PROMPTS:
        raise APIError(400, f'at most {MAX_PROMPTS} choices per request (prompts x n)', 'invalid_value', 'n')
    lease = Lease(state, req.session_id, request_owner(state, request), exclusive=True)
    internal = [lease.internal_id] + [state.gateway.next_session_id() for _ in range(len(prompts) * n - 1)]
    # choice index = prompt index * n + choice (OpenAI's order); a prompt's later choices wait for its
    # first and take its prompt blocks
    jobs = [Job(p * n + c, ids, g, internal[p * n + c], stream=bool(req.stream),
                after=p * n if c else None)
            for p, (ids, gen) in enumerate(zip(all_ids, gens)) for c, g in enumerate(choice_configs(gen, n))]
    # what echo puts first: the prompt as sent (token ids: their text)
    echoes = [(p if isinstance(p, str) else tt_decode(state, p)) if req.echo else '' for p in prompts]
    run, firsts = await runner.start(request, 'completions', lease, jobs)
    # one entry per choice from here on
    echo = _Echo(req.logprobs, [e for e in echoes for _ in range(n)], [ids for ids in all_ids for _ in range(n)],
                 runner.token_text())
    created = int(time.time())
    if not req.stream:
        results = await runner.collect(request, run, firsts, lease)
        return _response(state, req, rid, created, results, echo, n)
    stream = _CompletionStream(state, req, rid, created, echo, n, len(prompts) * n)
    return runner.stream(stream.events(run, firsts), run, lease, lambda: True, media_type='text/event-stream',
                         headers=SSE_HEADERS)


def _prompts(req: P.CompletionRequest) -> list:
    """The request's prompts (one string or token id list, or a list of them), checked."""
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
    return prompts


async def _generation_configs(state: ServerState, req: P.CompletionRequest, all_ids: List[List[int]]):
    """Each prompt's generation config (its response_format compiled: an unusable one is a 400)."""
    # OpenAI's default, for an absent or null max_tokens alike (not "up to session_len")
    max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    max_news = [max_new_tokens(state, len(ids), max_tokens) for ids in all_ids]
    top_n = req.logprobs
    gens = [gen_config(state, req, m, top_n) for m in max_news]
    if req.echo and top_n is not None:  # the prompt's logprobs, from its own forward pass
        gens = [dataclasses.replace(g, prompt_logprobs=top_n) for g in gens]
    await compile_grammar(state, spec_from_response_format(gens[0].response_format))
    return gens


class _Echo:
    """What echo puts ahead of each choice's text: its prompt and, with logprobs, the prompt tokens'
    entries (``texts`` and ``ids``: one per choice; ``texts`` are '' without echo)."""

    def __init__(self, top_n, texts: List[str], ids: List[List[int]], tt):
        self.top_n, self.texts, self.ids, self.tt = top_n, texts, ids, tt

    def __call__(self, i: int, r: Result):
        if self.top_n is None:
            return self.texts[i], None
        return self.texts[i], completion_logprobs(self.tt, self.ids[i], r.prompt_logprobs, self.top_n)

    def logprobs(self, token_ids, logprobs, offset: int, stop_token=None):
        """The generated tokens' entries, and the stop token's that ended the choice (as vLLM reports it:
        its text is not in the choice's text, but a client scoring a text reads its logprob, e.g.
        lm-evaluation-harness's last entry of a one-token completion)."""
        if stop_token is not None:
            token_ids, logprobs = list(token_ids) + [stop_token[0]], list(logprobs or []) + [stop_token[1]]
        return completion_logprobs(self.tt, token_ids, logprobs, self.top_n, offset)


def _usage(results: List[Result], n: int) -> P.UsageInfo:
    """Each prompt once (its first choice), every choice's tokens."""
    return usage_info(sum(r.input_tokens for r in results[::n]), sum(r.generated for r in results))


def _response(state: ServerState, req: P.CompletionRequest, rid: str, created: int, results: List[Result],
              echo: _Echo, n: int) -> P.CompletionResponse:
    """The whole reply of a request that does not stream."""
    choices = []
    for i, r in enumerate(results):
        head, head_logprobs = echo(i, r)
        logprobs = None
        if echo.top_n is not None:
            logprobs = echo.logprobs(r.token_ids, r.logprobs, len(head), r.stop_token)
            if head_logprobs is not None:
                logprobs = _joined(head_logprobs, logprobs)
        choices.append(P.CompletionChoice(index=i, text=head + r.text, finish_reason=r.finish_reason,
                                          logprobs=logprobs))
    return P.CompletionResponse(id=rid, created=created, model=state.model_name, choices=choices,
                                usage=_usage(results, n))


class _CompletionStream:
    """A streamed reply's server-sent events: each choice's echo (once its prompt logprobs are all in), its
    text with logprobs and finish reason, the usage if asked for, and ``[DONE]``."""

    def __init__(self, state: ServerState, req: P.CompletionRequest, rid: str, created: int, echo: _Echo, n: int,
                 choices: int):
        self.model, self.rid, self.created = state.model_name, rid, created
        self.echo, self.n, self.choices, self.echoing = echo, n, choices, bool(req.echo)
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.text_chunk = TextChunks(self.response([P.CompletionChoice(text='')]), self.include_usage)

    def response(self, choices, usage=None) -> P.CompletionResponse:
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices,
                                    usage=usage)

    async def events(self, run, firsts):
        echo, top_n, include_usage = self.echo, self.echo.top_n, self.include_usage
        results = [Result() for _ in range(self.choices)]
        offsets = [0] * self.choices
        waiting_echo = set(range(self.choices)) if self.echoing else set()
        async for i, out in run.iterate(firsts):
            accumulate(results[i], out)
            if out.finish_reason == 'error':
                yield sse(error_body(500, f'generation failed: {out.error}', 'internal_error'))
                break
            if i in waiting_echo:  # the prompt goes first, once its logprobs are all in
                if top_n is not None and not out.token_ids and out.finish_reason is None:
                    continue  # (a long prompt's logprobs come chunk by chunk)
                waiting_echo.discard(i)
                head, head_logprobs = echo(i, results[i])
                offsets[i] = len(head)
                yield sse(self.response([P.CompletionChoice(index=i, text=head, logprobs=head_logprobs)]),
                          include_usage)
            logprobs = None
            if top_n is not None and (out.token_ids or out.stop_token):
                logprobs = echo.logprobs(out.token_ids, out.logprobs, offsets[i], out.stop_token)
                offsets[i] += sum(len(t) for t in logprobs.tokens)
            if logprobs is not None:
                yield sse(self.response([P.CompletionChoice(index=i, text=out.text, logprobs=logprobs,
                                                            finish_reason=out.finish_reason)]), include_usage)
            elif out.text or out.finish_reason is not None:
                yield self.text_chunk(out.text, out.finish_reason, i)
        if include_usage:
            yield sse(self.response([], _usage(results, self.n)))
        yield 'data: [DONE]\n\n'


def tt_decode(state, ids) -> str:
    """A prompt given as token ids, as text (what echo repeats)."""
    return state.gateway.tokenizer.decode(ids, skip_special_tokens=False)


def _joined(head: P.CompletionLogprobs, tail: P.CompletionLogprobs) -> P.CompletionLogprobs:
    return P.CompletionLogprobs(tokens=head.tokens + tail.tokens,
                                token_logprobs=head.token_logprobs + tail.token_logprobs,
                                top_logprobs=head.top_logprobs + tail.top_logprobs,
                                text_offset=head.text_offset + tail.text_offset)
