"""Running generations for one request: pumping engine outputs, client disconnects, streaming responses."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Deque, Dict, List, Optional, Tuple

from fastapi import Request
from fastapi.responses import StreamingResponse

from lmdeploy.messages import GenerationConfig

from . import protocol as P
from .errors import APIError, ClientGone

if TYPE_CHECKING:
    from .state import ServerState

logger = logging.getLogger('lmdeploy.serve')


async def _wait_disconnect(receive):
    while True:
        message = await receive()
        if message['type'] == 'http.disconnect':
            return


async def race(request: Request, coro):
    """Await ``coro``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone()


@dataclass
class Job:
    index: int
    input_ids: List[int]
    gen: GenerationConfig
    session_id: int  # the engine's
    interactive: bool = False
    stream: bool = True  # False: the engine hands over the whole result at the end (less per-token work)
    # n > 1: start once this job (same prompt) has its first output, and take its prompt's KV blocks
    after: Optional[int] = None


@dataclass
class Result:
    text: str = ''
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[Dict[int, float]] = field(default_factory=list)
    prompt_logprobs: List[Optional[Dict[int, float]]] = field(default_factory=list)
    stop_token: Optional[Tuple[int, Dict[int, float]]] = None  # (id, logprobs entry): see GenOut
    input_tokens: int = 0
    generated: int = 0
    finish_reason: Optional[str] = None
    error: Optional[str] = None


def _failed_early(out) -> bool:
    """An engine refusal or failure before any token was generated."""
    return bool(out.error) and out.generate_token_len == 0 and out.finish_reason is not None


class Run:
    """One request's generations (one per prompt), merged into one stream of
    (index, GenOut). Outputs are pulled from the engine as they come, whatever
    the client's reading speed. :meth:`close` (synchronous, idempotent)
    cancels what still runs, which frees its KV blocks."""

    def __init__(self, state: ServerState, endpoint: str, jobs: List[Job]):
        self.state = state
        gateway = state.gateway
        self.jobs = jobs
        # (index, GenOut or None at a job's end), oldest first; ``_ready`` is set while it holds any
        self.queue: Deque[Tuple[int, Any]] = deque()
        self._ready = asyncio.Event()
        self.timers = [state.metrics.timer(endpoint, streaming=job.stream) for job in jobs]
        for timer, job in zip(self.timers, jobs):
            timer.prompt_tokens = len(job.input_ids)
        self._generated = [0] * len(jobs)
        self._open = len(jobs)
        self._closed = False
        self._prefilled = {job.index: asyncio.Event() for job in jobs}
        # a job others wait for streams, so that its first output comes as soon as its prompt is cached
        leaders = {job.after for job in jobs if job.after is not None}
        self.tasks = [asyncio.ensure_future(self._pump(job, gateway.generate(
            None, job.session_id, job.gen, input_ids=job.input_ids, interactive=job.interactive,
            stream_text=job.stream or job.index in leaders,
            share_prompt=job.after is not None or job.index in leaders))) for job in jobs]
        self._ended: set = set()  # jobs whose last output is queued
        state.runs.add(self)
        if state.cut_reason is not None:  # started as the drain was cut short
            self.cut(state.cut_reason)

    async def _pump(self, job: Job, gen):
        try:
            if job.after is not None:  # n > 1: the prompt's blocks are keyed once the first has a token
                await self._prefilled[job.after].wait()
            async with contextlib.aclosing(gen):
                async for out in gen:
                    self._prefilled[job.index].set()
                    self._put(job.index, out)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never expected: report it as this prompt's failure
            logger.exception('generation failed')
            from lmdeploy.frontend.gateway import GenOut
            self._put(job.index, GenOut('', len(job.input_ids), self._generated[job.index],
                                                     finish_reason='error', error=f'{type(e).__name__}: {e}'))
        finally:
            self._prefilled[job.index].set()
            self._put(job.index, None)

    def _put(self, index: int, out):
        if out is not None and out.finish_reason is not None:
            self._ended.add(index)
        self.queue.append((index, out))
        self._ready.set()

    def cut(self, why: str):
        """End every generation still running with ``why`` as its error (the server stops before they are
        done): the response then ends as a failed one does, with an error event (and ``[DONE]``), instead of
        being dropped mid-stream. The engine's requests are cancelled, which frees their KV blocks."""
        from lmdeploy.frontend.gateway import GenOut
        for job, task in zip(self.jobs, self.tasks):
            if job.index not in self._ended and not task.done():
                self._put(job.index, GenOut('', len(job.input_ids), self._generated[job.index],
                                            finish_reason='error', error=why))
                task.cancel()

    async def _get(self) -> Tuple[int, Any]:
        """The oldest item, with the same job's outputs queued right behind it folded in (a stream that fell
        behind catches up in one event; see gateway.take_pending)."""
        while not self.queue:
            self._ready.clear()
            await self._ready.wait()
        index, out = self.queue.popleft()
        while (out is not None and self.queue and self.queue[0][0] == index and self.queue[0][1] is not None
               and out.can_absorb(self.queue[0][1])):
            out = out.absorb(self.queue.popleft()[1])
        return index, out

    async def next(self):
        """The next (index, GenOut), or None when every generation has finished."""
        while self._open > 0:
            index, out = await self._get()
            if out is None:
                self._open -= 1
                continue
            timer = self.timers[index]
            timer.tokens(out.generate_token_len - self._generated[index])
            self._generated[index] = out.generate_token_len
            if out.finish_reason is not None:
                timer.prompt_tokens = out.input_token_len or timer.prompt_tokens
                timer.finish(out.finish_reason)
            return index, out
        return None

    async def firsts(self) -> List[Tuple[int, Any]]:
        """Wait for the first output of every generation (errors before generation show here)."""
        seen, items = set(), []
        while len(seen) < len(self.jobs):
            item = await self.next()
            if item is None:
                break
            items.append(item)
            seen.add(item[0])
        return items

    async def iterate(self, buffered) -> AsyncIterator[Tuple[int, Any]]:
        for item in buffered:
            yield item
        while (item := await self.next()) is not None:
            yield item

    def close(self):
        if self._closed:
            return
        self._closed = True
        self.state.runs.discard(self)
        for task in self.tasks:
            if not task.done():
                task.cancel()
        for timer in self.timers:
            timer.finish('abort')


def accumulate(r: Result, out):
    r.text += out.text
    r.token_ids.extend(out.token_ids)
    if out.logprobs:
        r.logprobs.extend(out.logprobs)
    if out.prompt_logprobs:
        r.prompt_logprobs.extend(out.prompt_logprobs)
    r.stop_token = out.stop_token or r.stop_token
    r.input_tokens = out.input_token_len or r.input_tokens
    r.generated = out.generate_token_len
    if out.finish_reason is not None:
        r.finish_reason = out.finish_reason
    if out.error:
        r.error = out.error


def raise_early_failure(items, state: ServerState):
    for _, out in items:
        if _failed_early(out):
            if out.finish_reason == 'abort' and (state.draining or 'shutting down' in (out.error or '')):
                raise APIError(503, out.error or 'the server is shutting down', 'shutting_down')
            if out.finish_reason == 'length':  # the prompt (with the session's history) does not fit
                raise APIError(400, out.error, 'context_length_exceeded')
            if out.refused:
                raise APIError(400, out.error, 'invalid_request')
            # the engine's own failure (a fault, not something in the request): never the client's error
            raise APIError(500, f'generation failed: {out.error}', 'internal_error')


class StreamResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close`` (sync), however it ends:
    finished, client gone, or cancelled."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


SSE_HEADERS = {'Cache-Control': 'no-cache', 'X-Accel-Buffering': 'no'}


def _chunk_body(model, with_usage: bool) -> Dict[str, Any]:
    """A stream chunk's JSON object, as OpenAI writes it."""
    obj = model.model_dump(exclude_none=False)
    for choice in obj.get('choices') or []:
        delta = choice.get('delta')
        if isinstance(delta, dict):  # as OpenAI: a delta names only what it carries
            choice['delta'] = _drop_none(delta)
    if not with_usage:  # OpenAI sends "usage" only with stream_options.include_usage
        obj.pop('usage', None)
    return obj


def _drop_none(obj):
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


def sse(obj, with_usage: bool = True) -> str:
    if isinstance(obj, P.APIModel):
        obj = _chunk_body(obj, with_usage)
    return f'data: {json.dumps(obj, ensure_ascii=False)}\n\n'


class TextChunks:
    """SSE chunks that carry only text (and maybe a finish reason), as
    ``sse`` writes them: the response model is dumped once and each chunk
    copies that dump with its text in place (a pydantic model per token cost
    16-19 us on a 2-core CPU, this 6-9: streams at a GPU's pace are thousands
    of chunks a second). ``template``'s first choice gives the choice's shape:
    a chat ``delta`` or a completion ``text``."""

    def __init__(self, template, with_usage: bool):
        self._obj = _chunk_body(template, with_usage)
        self._choice = self._obj['choices'][0]

    def __call__(self, text: str, finish_reason: Optional[str] = None, index: int = 0) -> str:
        choice = dict(self._choice, index=index, finish_reason=finish_reason)
        if 'delta' in choice:
            choice['delta'] = {'content': text}
        else:
            choice['text'] = text
        return f'data: {json.dumps(dict(self._obj, choices=[choice]), ensure_ascii=False)}\n\n'
