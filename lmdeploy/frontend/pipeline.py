"""The synchronous, batteries-included API: ``pipeline(model)(prompts)``.

A private asyncio loop runs on a background thread; every public method
submits coroutines of the shared :class:`Gateway` to it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig, RequestError, Response

from .chat_template import ChatTemplateConfig
from .gateway import Gateway, GenOut

logger = logging.getLogger('lmdeploy')
Prompts = Union[str, List[Dict[str, Any]], List[int], List[str], List[List[Dict[str, Any]]], List[List[int]]]
_DONE = object()


def _is_messages(p: Any) -> bool:
    return isinstance(p, list) and all(isinstance(m, dict) for m in p) and len(p) > 0


def _is_token_ids(p: Any) -> bool:
    return isinstance(p, list) and len(p) > 0 and all(isinstance(t, int) for t in p)


def normalize_prompts(prompts: Prompts):
    """-> (list of prompts, whether the caller passed a single prompt).

    A prompt is a str, a list of OpenAI-style messages, or a list of token
    ids (sent as is: no chat template)."""
    if isinstance(prompts, str) or _is_messages(prompts) or _is_token_ids(prompts):
        return [prompts], True
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError('no prompts given')
        for p in prompts:
            if not (isinstance(p, str) or _is_messages(p) or _is_token_ids(p)):
                raise TypeError('each prompt must be a str, a non-empty list of {"role", "content"} messages '
                                f'or a list of token ids, got {type(p).__name__}')
        return list(prompts), False
    raise TypeError(f'prompts must be a str, a list of messages, or a list of those; got {type(prompts).__name__}')


def _longest_first(gens: List[GenerationConfig]) -> List[int]:
    """A batch's submission order: longest ``max_new_tokens`` first; ties,
    and invalid values (each fails its own request later), in input order."""

    def limit(g) -> int:
        m = getattr(g, 'max_new_tokens', None)
        return m if isinstance(m, int) else 0

    return sorted(range(len(gens)), key=lambda i: -limit(gens[i]))


def _raise_refused(results: List[Response], single: bool):
    """No silent failures: a refused request raises, naming the prompt and the reason."""
    bad = [i for i, r in enumerate(results) if r.refused]
    if not bad:
        return
    first = results[bad[0]]
    where = '' if single else f'prompt {bad[0]} of {len(results)}' + (
        f' (and {len(bad) - 1} more)' if len(bad) > 1 else '') + ': '
    raise RequestError(f'{where}{first.error}', results, bad[0])


def _log_refused(resp: Response):
    if resp.refused:
        logger.error('request %d (prompt %d) refused: %s', resp.session_id, resp.index, resp.error)


def _reject_unknown(method: str, kwargs: Dict[str, Any]):
    """Unknown arguments are refused, not silently ignored (None values,
    e.g. LMDeploy's adapter_name=None, change nothing and pass)."""
    unknown = sorted(k for k, v in kwargs.items() if v is not None)
    if unknown:
        raise TypeError(f'Pipeline.{method}() got unsupported arguments: {unknown}')


class _Accumulator:
    """Builds a Response out of GenOut increments."""

    def __init__(self, session_id: int, index: int):
        self.resp = Response(text='', generate_token_len=0, input_token_len=0, session_id=session_id, index=index)
        self._logits: List[Any] = []
        self._hidden: List[Any] = []

    def add(self, out: GenOut) -> Response:
        r = self.resp
        r.text += out.text
        r.token_ids.extend(out.token_ids)
        r.generate_token_len = out.generate_token_len
        r.input_token_len = out.input_token_len
        r.finish_reason = out.finish_reason
        if out.error:
            r.error = out.error
        if out.logprobs:
            r.logprobs = (r.logprobs or []) + out.logprobs
        if out.logits is not None:
            self._logits.append(out.logits)
        if out.last_hidden_state is not None:
            self._hidden.append(out.last_hidden_state)
        return r

    def result(self) -> Response:
        import torch
        if self._logits:
            self.resp.logits = torch.cat(self._logits)
        if self._hidden:
            self.resp.last_hidden_state = torch.cat(self._hidden)
        return self.resp


@dataclass
class Session:
    """A multi-turn chat whose KV cache stays in the engine between turns."""
    session_id: int
    step: int = 0  # turns so far
    history: List[Dict[str, str]] = field(default_factory=list)
    response: Optional[Response] = None


class Pipeline:

    def __init__(self, model_path: str, backend_config: Optional[PytorchEngineConfig] = None,
                 chat_template_config: Optional[ChatTemplateConfig] = None, model_name: Optional[str] = None):
        self.gateway = Gateway(model_path, backend_config, chat_template_config, model_name)
        self.engine = self.gateway.engine
        self.tokenizer = self.gateway.tokenizer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name='lmdeploy-pipeline', daemon=True)
        self._thread.start()
        self._closed = False

    # -------------------------------------------------------------- helpers
    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @staticmethod
    def _gen_configs(gen_config, n: int) -> List[GenerationConfig]:
        if gen_config is None:
            return [GenerationConfig()] * n
        if isinstance(gen_config, GenerationConfig):
            return [gen_config] * n
        if isinstance(gen_config, (list, tuple)):
            if len(gen_config) != n:
                raise ValueError(f'got {len(gen_config)} GenerationConfigs for {n} prompts')
            return list(gen_config)
        raise TypeError('gen_config must be a GenerationConfig or a list of them')

    async def _one(self, prompt, gen: GenerationConfig, index: int, do_preprocess: bool, sink=None,
                   **kwargs) -> Response:
        session_id = kwargs.pop('session_id', None) or self.gateway.next_session_id()
        acc = _Accumulator(session_id, index)
        if _is_token_ids(prompt):
            prompt, kwargs['input_ids'] = None, prompt
        kwargs.setdefault('stream_text', sink is not None)
        async for out in self.gateway.generate(prompt, session_id, gen, do_preprocess=do_preprocess, **kwargs):
            resp = acc.add(out)
            if sink is not None:
                piece = Response(text=out.text, generate_token_len=resp.generate_token_len,
                                 input_token_len=resp.input_token_len, session_id=session_id,
                                 finish_reason=out.finish_reason, token_ids=list(out.token_ids),
                                 logprobs=out.logprobs, logits=out.logits, last_hidden_state=out.last_hidden_state,
                                 index=index, error=out.error)
                _log_refused(piece)  # (a streaming caller gets it as a Response: said once in the log too)
                sink(piece)
        return acc.result()

    # ---------------------------------------------------------------- API
    def __call__(self, prompts: Prompts, gen_config=None, do_preprocess: bool = True, use_tqdm: bool = False,
                 **kwargs) -> Union[Response, List[Response]]:
        return self.infer(prompts, gen_config, do_preprocess, use_tqdm, **kwargs)

    def infer(self, prompts: Prompts, gen_config=None, do_preprocess: bool = True, use_tqdm: bool = False,
              **kwargs) -> Union[Response, List[Response]]:
        """Generate for one prompt or a batch; results come back in input order.
        A request the engine refuses raises :class:`RequestError` (the other
        results ride on it, as ``responses``).

        A batch reaches the engine longest ``max_new_tokens`` first (ties in
        input order): all results return together, and this order keeps the
        longest requests from running nearly alone at the end of the batch
        (fewer, fuller decode steps for the same tokens)."""
        _reject_unknown('infer', kwargs)
        items, single = normalize_prompts(prompts)
        gens = self._gen_configs(gen_config, len(items))
        order = _longest_first(gens)

        async def run_all():
            bar = None
            if use_tqdm:
                from tqdm import tqdm
                bar = tqdm(total=len(items), desc='generating')

            async def one(i):
                resp = await self._one(items[i], gens[i], i, do_preprocess)
                if bar is not None:
                    bar.update(1)
                return resp

            try:
                done = await asyncio.gather(*(one(i) for i in order))
            finally:
                if bar is not None:
                    bar.close()
            results = [None] * len(items)
            for i, resp in zip(order, done):
                results[i] = resp
            return results

        results = self._run(run_all())
        _raise_refused(results, single)
        return results[0] if single else results

    def stream_infer(self, prompts: Prompts, gen_config=None, do_preprocess: bool = True,
                     **kwargs) -> Iterator[Response]:
        """Yield increments (``Response.text`` holds the new text; ``index``
        says which prompt) as they are produced."""
        _reject_unknown('stream_infer', kwargs)
        items, _ = normalize_prompts(prompts)
        gens = self._gen_configs(gen_config, len(items))
        q: queue.Queue = queue.Queue()

        async def run_all():
            try:
                await asyncio.gather(*(self._one(p, g, i, do_preprocess, sink=q.put)
                                       for i, (p, g) in enumerate(zip(items, gens))))
            finally:
                q.put(_DONE)

        future = asyncio.run_coroutine_threadsafe(run_all(), self._loop)
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    break
                yield item
            future.result()
        finally:
            if not future.done():  # the caller stopped early: cancel what still runs
                future.cancel()

    def chat(self, prompt: Union[str, List[Dict[str, Any]]], session: Optional[Session] = None,
             gen_config: Optional[GenerationConfig] = None, stream_response: bool = False,
             **kwargs) -> Union[Session, Iterator[Response]]:
        """One turn of a multi-turn chat. The session's KV cache stays in the
        engine, so earlier turns are not prefilled again."""
        _reject_unknown('chat', kwargs)
        if session is None:
            session = Session(self.gateway.next_session_id())
        messages = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else list(prompt)
        first = session.step == 0
        gen = gen_config or GenerationConfig()

        async def turn(sink=None):
            return await self._one(messages, gen, 0, True, sink=sink, session_id=session.session_id,
                                   sequence_start=first, interactive=True)

        def record(resp: Response):
            session.history.extend(messages)
            session.history.append({'role': 'assistant', 'content': resp.text})
            session.response = resp
            session.step += 1

        if not stream_response:
            resp = self._run(turn())
            _raise_refused([resp], True)
            record(resp)
            return session

        def stream():
            q: queue.Queue = queue.Queue()

            async def run():
                try:
                    return await turn(sink=q.put)
                finally:
                    q.put(_DONE)

            future = asyncio.run_coroutine_threadsafe(run(), self._loop)
            while (item := q.get()) is not _DONE:
                yield item
            record(future.result())

        return stream()

    def end_session(self, session: Union[Session, int]):
        """Free an interactive session's cache."""
        self.gateway.end_session(session.session_id if isinstance(session, Session) else session)

    def get_ppl(self, input_ids: Union[List[int], List[List[int]]]) -> List[float]:
        """Mean cross-entropy of each token sequence (transformers' loss)."""
        if not input_ids:
            raise ValueError('input_ids is empty')
        batch = [input_ids] if isinstance(input_ids[0], int) else input_ids
        gen = GenerationConfig(max_new_tokens=1)

        async def one(ids: Sequence[int]) -> float:
            if len(ids) < 2:
                raise ValueError('get_ppl needs sequences of at least 2 tokens')
            loss = None
            async for out in self.gateway.generate(None, self.gateway.next_session_id(), gen, input_ids=list(ids),
                                                   prompt_loss=True):
                if out.error:
                    raise ValueError(out.error)
                loss = out.prompt_loss if out.prompt_loss is not None else loss
            return loss

        async def run_all():
            return await asyncio.gather(*(one(ids) for ids in batch))

        return self._run(run_all())

    def close(self):
        if not self._closed:
            self._closed = True
            self.gateway.close()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
