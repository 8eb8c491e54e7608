"""``POST /generate``: LMDeploy's native API (interactive sessions that keep their KV cache, token ids in
and out, newline-delimited JSON streaming, cancel).

:func:`generate` is the handler (:func:`add_routes` registers it): a control request (cancel, end_session) is
answered by :func:`_control`; otherwise the session is found or made, the prompt encoded (:func:`_prompt_ids`),
one job started on the :class:`~.runner.Runner`, and its output returned at once or streamed as lines.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import Depends, FastAPI, Request

from . import protocol as P
from .errors import APIError, error_body
from .functions import messages as legacy_messages
from .guard import request_owner
from .jobs import Job
from .params import check_ids, encode, finite, gen_config, max_new_tokens, prompt_messages
from .runner import Runner, request_runner
from .sessions import Lease, end_session, session_not_found
from .state import ServerState


def add_routes(app: FastAPI, auth, err):
    """Register ``POST /generate`` (the handler gets the app's Runner from :func:`request_runner`)."""
    app.post('/generate', response_model=P.GenerateResponse, dependencies=auth,
             responses={**err, 200: {'content': {'application/x-ndjson': {}}}})(generate)


async def generate(req: P.GenerateRequest, request: Request, runner: Runner = Depends(request_runner)):
    state = runner.state
    if req.max_tokens is not None and req.request_output_len is not None:
        raise APIError(400, f'max_tokens ({req.max_tokens}) and request_output_len ({req.request_output_len}) '
                       'name the same limit: give one of them', 'invalid_value', 'max_tokens')
    owner = request_owner(state, request)
    token = req.session_token
    existing = state.sessions.find(owner, req.session_id, token)
    empty = req.input_ids is None and req.prompt in ('', [])
    if req.cancel or req.end_session or (empty and not req.interactive_mode and existing is not None):
        return _control(state, req, existing)
    if token is not None and existing is None:
        raise session_not_found()
    client_id = existing.client_id if existing is not None else req.session_id
    if client_id == -1:
        client_id = state.sessions.auto_id(owner)
    if existing is not None and existing.busy:
        raise APIError(400, f'session {client_id} is busy with another request', 'session_busy', 'session_id')
    sequence_start = existing is None or existing.turns == 0
    ids, prompt_for_log = _prompt_ids(state, req, sequence_start)
    # a continuation's history is in the engine: only the engine can check its length
    max_new = max_new_tokens(state, len(ids), req.request_output_len or req.max_tokens, check=sequence_start)
    gen = gen_config(state, req, max_new, req.logprobs)
    rid = f'generate-{uuid.uuid4().hex}'
    runner.log_request(rid, 'generate', prompt_for_log, ids, gen)
    lease = Lease(state, client_id, owner, token, keep=req.interactive_mode)
    session_token = lease.session.token
    run, firsts = await runner.start(request, 'generate', lease, [
        Job(0, ids, gen, lease.internal_id, interactive=req.interactive_mode, stream=req.stream)])

    def response(r_text, tokens, input_tokens, finish_reason, token_ids, logprobs):
        return P.GenerateResponse(
            text=r_text, tokens=tokens, input_tokens=input_tokens,
            history_tokens=max(0, input_tokens - len(ids)), finish_reason=finish_reason, session_id=client_id,
            session_token=session_token,
            token_ids=list(token_ids), logprobs=[{str(k): finite(v) for k, v in lp.items()}
                                                 for lp in logprobs] if req.logprobs is not None else None)

    if not req.stream:
        r = (await runner.collect(request, run, firsts, lease))[0]
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
    return runner.stream(lines(), run, lease, lambda: bool(completed), media_type='application/x-ndjson')


def _control(state: ServerState, req: P.GenerateRequest, existing) -> P.GenerateResponse:
    """cancel, end_session, or an empty non-interactive prompt to an existing session (ends it): answered
    alike whether the session exists or not, as another client's must not show."""
    if existing is not None:
        if req.cancel:
            state.gateway.cancel(existing.internal_id)
        else:
            end_session(state, existing)
    return P.GenerateResponse(text='', tokens=0, input_tokens=0, session_id=req.session_id,
                              finish_reason='abort' if req.cancel else 'stop', session_token=req.session_token)


def _prompt_ids(state: ServerState, req: P.GenerateRequest, sequence_start: bool):
    """The prompt's token ids (given, or the prompt encoded) and what the request log shows of it."""
    if req.input_ids is not None:
        return check_ids(state, req.input_ids, 'input_ids'), str(req.input_ids)
    prompt: Any = req.prompt if isinstance(req.prompt, str) else prompt_messages(legacy_messages(req.prompt))
    return encode(state, prompt, do_preprocess=req.do_preprocess, sequence_start=sequence_start), prompt
