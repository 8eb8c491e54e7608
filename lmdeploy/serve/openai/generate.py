"""``POST /generate``: LMDeploy's native API (interactive sessions that keep their KV cache, token ids in
and out, newline-delimited JSON streaming, cancel)."""
from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import FastAPI, Request

from . import protocol as P
from .errors import APIError, error_body
from .jobs import _Job
from .functions import messages as legacy_messages
from .params import _check_ids, _encode, _finite, _gen_config, _max_new_tokens, _messages
from .runner import Runner
from .guard import request_owner
from .sessions import _end_session, _Lease, _not_found


def add_routes(app: FastAPI, runner: Runner, auth, err):
    state = runner.state

    # --------------------------------------------------------------- generate
    @app.post('/generate', response_model=P.GenerateResponse, dependencies=auth,
              responses={**err, 200: {'content': {'application/x-ndjson': {}}}})
    async def generate(req: P.GenerateRequest, request: Request):
        if req.max_tokens is not None and req.request_output_len is not None:
            raise APIError(400, f'max_tokens ({req.max_tokens}) and request_output_len ({req.request_output_len}) '
                           'name the same limit: give one of them', 'invalid_value', 'max_tokens')
        owner = request_owner(state, request)
        token = req.session_token
        existing = state.sessions.find(owner, req.session_id, token)
        empty = req.input_ids is None and req.prompt in ('', [])
        if req.cancel or req.end_session or (empty and not req.interactive_mode and existing is not None):
            # answered alike whether the session exists or not: another client's must not show
            if existing is not None:
                if req.cancel:
                    state.gateway.cancel(existing.internal_id)
                else:
                    _end_session(state, existing)
            return P.GenerateResponse(text='', tokens=0, input_tokens=0, session_id=req.session_id,
                                      finish_reason='abort' if req.cancel else 'stop', session_token=token)
        if token is not None and existing is None:
            raise _not_found()
        client_id = existing.client_id if existing is not None else req.session_id
        if client_id == -1:
            client_id = state.sessions.auto_id(owner)
        if existing is not None and existing.busy:
            raise APIError(400, f'session {client_id} is busy with another request', 'session_busy', 'session_id')
        sequence_start = existing is None or existing.turns == 0
        if req.input_ids is not None:
            ids = _check_ids(state, req.input_ids, 'input_ids')
            prompt_for_log: Any = str(req.input_ids)
        else:
            prompt = req.prompt if isinstance(req.prompt, str) else _messages(legacy_messages(req.prompt))
            ids = _encode(state, prompt, do_preprocess=req.do_preprocess, sequence_start=sequence_start)
            prompt_for_log = prompt
        # a continuation's history is in the engine: only the engine can check its length
        max_new = _max_new_tokens(state, len(ids), req.request_output_len or req.max_tokens, check=sequence_start)
        gen = _gen_config(state, req, max_new, req.logprobs)
        rid = f'generate-{uuid.uuid4().hex}'
        runner.log_request(rid, 'generate', prompt_for_log, ids, gen)
        lease = _Lease(state, client_id, owner, token, keep=req.interactive_mode)
        session_token = lease.session.token
        run, firsts = await runner.start(request, 'generate', lease, [
            _Job(0, ids, gen, lease.internal_id, interactive=req.interactive_mode, stream=req.stream)])

        def response(r_text, tokens, input_tokens, finish_reason, token_ids, logprobs):
            return P.GenerateResponse(
                text=r_text, tokens=tokens, input_tokens=input_tokens,
                history_tokens=max(0, input_tokens - len(ids)), finish_reason=finish_reason, session_id=client_id,
                session_token=session_token,
                token_ids=list(token_ids), logprobs=[{str(k): _finite(v) for k, v in lp.items()}
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
