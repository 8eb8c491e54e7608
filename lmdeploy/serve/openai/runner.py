"""What every generation endpoint does with a request once it is checked: start its jobs under a
session lease, then collect their outputs into one response or stream them; plus the request log."""
from __future__ import annotations

import json
import logging
from typing import Callable, Dict, List, Tuple

from fastapi import Request

from lmdeploy.messages import GenerationConfig

from .errors import APIError
from .jobs import Job, Result, Run, StreamResponse, accumulate, race, raise_early_failure
from .params import TokenText
from .sessions import Lease
from .state import ServerState

logger = logging.getLogger('lmdeploy.serve')


class Runner:
    """Runs one request's jobs for an endpoint handler (``chat``, ``completions``, ``generate``)."""

    def __init__(self, state: ServerState):
        self.state = state
        self._token_text: Dict[int, TokenText] = {}

    def token_text(self) -> TokenText:
        """Token id -> its text (for logprobs), cached per tokenizer."""
        tok = self.state.gateway.tokenizer
        if id(tok) not in self._token_text:
            self._token_text = {id(tok): TokenText(tok)}
        return self._token_text[id(tok)]

    async def start(self, request: Request, endpoint: str, lease: Lease, jobs: List[Job]) -> Tuple[Run, List]:
        """Start the jobs and wait for their first outputs: errors before generation are a 4xx / 503, and end
        the lease as failed."""
        try:
            run = Run(self.state, endpoint, jobs)
            try:
                firsts = await race(request, run.firsts())
                raise_early_failure(firsts, self.state)
            except BaseException:
                run.close()
                raise
            return run, firsts
        except BaseException:
            lease.end(failed=True)
            raise

    async def collect(self, request: Request, run: Run, firsts, lease: Lease) -> List[Result]:
        """Everything a non-streaming request generates; its lease ends with it."""
        failed = True
        try:
            try:
                results = [Result() for _ in run.jobs]
                for i, out in firsts:
                    accumulate(results[i], out)

                async def rest():
                    while (item := await run.next()) is not None:
                        accumulate(results[item[0]], item[1])
                    return results

                results = await race(request, rest())
            finally:
                run.close()
            failed = any(r.finish_reason == 'error' for r in results)
        finally:
            lease.end(failed)
        for r in results:
            if r.finish_reason == 'error':
                raise APIError(500, f'generation failed: {r.error}', 'internal_error')
        return results

    def stream(self, body, run: Run, lease: Lease, completed: Callable[[], bool] = lambda: True,
               **kw) -> StreamResponse:
        """A streamed response; closing it (at its end, or when the client goes) stops the jobs and ends the
        lease, as failed unless ``completed()``."""
        def on_close():
            run.close()
            lease.end(failed=not completed())
        return StreamResponse(body, on_close, **kw)

    def log_request(self, rid: str, kind: str, prompt, ids: List[int], gen: GenerationConfig):
        if logger.isEnabledFor(logging.INFO):
            text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
            logger.info('%s %s: %d prompt tokens, max_new_tokens=%d, prompt=%r', kind, rid, len(ids),
                        gen.max_new_tokens, self.state.clip(text))


def request_runner(request: Request) -> Runner:
    """The endpoint handlers' FastAPI dependency: the app's :class:`Runner` (``create_app`` keeps it on
    ``app.state.runner``)."""
    return request.app.state.runner
