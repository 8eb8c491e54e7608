"""``POST /v1/completions``: OpenAI's text completions (several prompts, n choices each, logprobs)."""
from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import FastAPI, Request

from lmdeploy.engine.grammar import spec_from_response_format

from . import protocol as P
from .errors import APIError, error_body
from .guard import request_owner
from .jobs import _SSE_HEADERS, _accumulate, _Job, _Result, _sse, _TextChunks
from .params import (COMPLETION_MAX_TOKENS, MAX_PROMPTS, _check_ids, _check_model, _check_unsupported, _choices,
                     _compile_grammar, _completion_logprobs, _encode, _gen_config, _max_new_tokens, _usage)
from .runner import Runner
from .sessions import _Lease


def add_routes(app: FastAPI, runner: Runner, auth, err):
    state = runner.state

    # ------------------------------------------------------------ completions
    @app.post('/v1/completions', response_model=P.CompletionResponse, dependencies=auth,
              responses={**err, 200: {'content': {'text/event-stream': {}}}})
    async def completions(req: P.CompletionRequest, request: Request):
        _check_model(state, req.model)
        _check_unsupported(req)
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
        # OpenAI's default, for an absent or null max_tokens alike (not "up to session_len")
        max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        max_news = [_max_new_tokens(state, len(ids), max_tokens) for ids in all_ids]
        top_n, echo = req.logprobs, bool(req.echo)
        gens = [_gen_config(state, req, m, top_n) for m in max_news]
        if echo and top_n is not None:  # the prompt's logprobs, from its own forward pass
            gens = [dataclasses.replace(g, prompt_logprobs=top_n) for g in gens]
        await _compile_grammar(state, spec_from_response_format(gens[0].response_format))
        rid = f'cmpl-{uuid.uuid4().hex}'
        for p, ids, gen in zip(prompts, all_ids, gens):
            runner.log_request(rid, 'completion', p if isinstance(p, str) else str(p), ids, gen)
        n = req.n or 1
        if len(prompts) * n > MAX_PROMPTS:
            raise APIError(400, f'at most {MAX_PROMPTS} choices per request (prompts x n)', 'invalid_value', 'n')
        lease = _Lease(state, req.session_id, request_owner(state, request), exclusive=True)
        internal = [lease.internal_id] + [state.gateway.next_session_id() for _ in range(len(prompts) * n - 1)]
        # choice index = prompt index * n + choice (OpenAI's order); a prompt's later choices wait for its
        # first and take its prompt blocks
        jobs = [_Job(p * n + c, ids, g, internal[p * n + c], stream=bool(req.stream),
                     after=p * n if c else None)
                for p, (ids, gen) in enumerate(zip(all_ids, gens)) for c, g in enumerate(_choices(gen, n))]
        # what echo puts first: the prompt as sent (token ids: their text)
        echoes = [(p if isinstance(p, str) else tt_decode(state, p)) if echo else '' for p in prompts]
        all_ids = [ids for ids in all_ids for _ in range(n)]
        prompts = [p for p in prompts for _ in range(n)]
        echoes = [e for e in echoes for _ in range(n)]
        run, firsts = await runner.start(request, 'completions', lease, jobs)
        created = int(time.time())
        tt = runner.token_text()

        def echoed(i: int, r: _Result):
            """The choice's echo: its prompt text and, with logprobs, the prompt tokens' entries."""
            if top_n is None:
                return echoes[i], None
            return echoes[i], _completion_logprobs(tt, all_ids[i], r.prompt_logprobs, top_n)

        if not req.stream:
            results = await runner.collect(request, run, firsts, lease)
            choices = []
            for i, r in enumerate(results):
                head, head_logprobs = echoed(i, r)
                logprobs = None
                if top_n is not None:
                    logprobs = _completion_logprobs(tt, r.token_ids, r.logprobs, top_n, offset=len(head))
                    if head_logprobs is not None:
                        logprobs = _joined(head_logprobs, logprobs)
                choices.append(P.CompletionChoice(index=i, text=head + r.text, finish_reason=r.finish_reason,
                                                  logprobs=logprobs))
            return P.CompletionResponse(id=rid, created=created, model=state.model_name, choices=choices,
                                        usage=_usage(sum(r.input_tokens for r in results[::n]),
                                                     sum(r.generated for r in results)))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        text_chunk = _TextChunks(P.CompletionResponse(id=rid, created=created, model=state.model_name,
                                                      choices=[P.CompletionChoice(text='')]), include_usage)

        async def events():
            results = [_Result() for _ in prompts]
            offsets = [0] * len(prompts)
            waiting_echo = set(range(len(prompts))) if echo else set()
            async for i, out in run.iterate(firsts):
                _accumulate(results[i], out)
                if out.finish_reason == 'error':
                    yield _sse(error_body(500, f'generation failed: {out.error}', 'internal_error'))
                    break
                if i in waiting_echo:  # the prompt goes first, once its logprobs are all in
                    if top_n is not None and not out.token_ids and out.finish_reason is None:
                        continue  # (a long prompt's logprobs come chunk by chunk)
                    waiting_echo.discard(i)
                    head, head_logprobs = echoed(i, results[i])
                    offsets[i] = len(head)
                    yield _sse(P.CompletionResponse(id=rid, created=created, model=state.model_name, choices=[
                        P.CompletionChoice(index=i, text=head, logprobs=head_logprobs)]), include_usage)
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

        return runner.stream(events(), run, lease, lambda: True, media_type='text/event-stream', headers=_SSE_HEADERS)


def tt_decode(state, ids) -> str:
    """A prompt given as token ids, as text (what echo repeats)."""
    return state.gateway.tokenizer.decode(ids, skip_special_tokens=False)


def _joined(head: P.CompletionLogprobs, tail: P.CompletionLogprobs) -> P.CompletionLogprobs:
    return P.CompletionLogprobs(tokens=head.tokens + tail.tokens, token_logprobs=head.token_logprobs + tail.token_logprobs,
                                top_logprobs=head.top_logprobs + tail.top_logprobs,
                                text_offset=head.text_offset + tail.text_offset)
