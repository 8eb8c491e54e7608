"""The synchronous, batteries-included API: ``pipeline(model)(prompts)``.

A private asyncio loop runs on a background thread; every public method
submits coroutines of the shared :class:`Gateway` to it. A pipeline is
closed by ``close()``, by ``with``, when it is collected, or at interpreter
exit at the latest (lmdeploy.at_exit); a closed one refuses every call.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from lmdeploy.at_exit import close_at_exit
from lmdeploy.messages import MAX_N, GenerationConfig, PytorchEngineConfig, RequestError, Response

from .chat_template import ChatTemplateConfig
from .gateway import Gateway, GenOut

logger = logging.getLogger('lmdeploy')
Prompts = Union[str, List[Dict[str, Any]], List[int], List[str], List[List[Dict[str, Any]]], List[List[int]]]
_DONE = object()
_CLOSED = 'the pipeline is closed: make a new one with pipeline(...)'


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


def _raise_refused(responses: List[Response], single: bool, num_prompts: int, results=None):
    """No silent failures: a refused request raises, naming the prompt and the reason. ``results``: what
    the call would have returned (``RequestError.responses``)."""
    bad = [r for r in responses if r.refused]
    if not bad:
        return
    first = bad[0]
    prompts = sorted({r.index for r in bad})
    where = '' if single else f'prompt {first.index} of {num_prompts}' + (
        f' (and {len(prompts) - 1} more)' if len(prompts) > 1 else '') + ': '
    raise RequestError(f'{where}{first.error}', results if results is not None else responses, first.index)


@dataclass
class _Sample:
    """One sample to generate: prompt ``index``'s sample ``choice`` of n."""
    index: int
    choice: int
    prompt: Any
    gen: Any
    after: Optional[int] = None  # a sample of the same prompt (choice 0) whose first output it waits for


def _num_samples(gen: Any) -> int:
    """``GenerationConfig.n`` where it is valid; else 1, and the gateway refuses the request with the reason."""
    n = getattr(gen, 'n', 1) if isinstance(gen, GenerationConfig) else 1
    return n if isinstance(n, int) and 1 <= n <= MAX_N else 1


def _expand(items: List[Any], gens: List[Any]) -> List[_Sample]:
    """Each prompt's n samples (``GenerationConfig.n``): sample c draws with ``random_seed + c``; the
    later ones start once the first has output, and take its prompt's blocks (one prefill, not n)."""
    samples = []
    for i, (p, g) in enumerate(zip(items, gens)):
        n = _num_samples(g)
        first = len(samples)
        for c in range(n):
            gc = g
            if n > 1:
                seed = None if g.random_seed is None else (g.random_seed + c) & 0xFFFFFFFF
                gc = dataclasses.replace(g, n=1, random_seed=seed)
            samples.append(_Sample(i, c, p, gc, first if c else None))
    return samples


def _group(items: List[Any], gens: List[Any], samples: List[_Sample], responses: List[Response]) -> List[Any]:
    """Per prompt: its Response, or the list of its n Responses."""
    out: List[Any] = [[] for _ in items]
    for sample, resp in zip(samples, responses):
        out[sample.index].append(resp)
    return [rs if _num_samples(g) > 1 else rs[0] for rs, g in zip(out, gens)]


async def _gather_or_cancel(coros) -> list:
    """``asyncio.gather`` that, when one fails, cancels the others and waits for them before raising: no
    request of a failed call keeps running in the engine (and holding its blocks) after the caller is told."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def check_ppl_inputs(batch: Sequence[Any], vocab_size: int, session_len: int):
    """Every sequence of a get_ppl call is checked before any starts: token ids in the vocabulary, at least 2
    of them (a loss needs a next token), fewer than ``session_len``."""
    for i, ids in enumerate(batch):
        where = f'input_ids[{i}]' if len(batch) > 1 else 'input_ids'
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in ids):
            raise TypeError(f'get_ppl: {where} must be a list of token ids (ints), got {type(ids).__name__}'
                            + ('' if not isinstance(ids, (list, tuple)) else ' holding other things'))
        if len(ids) < 2:
            raise ValueError(f'get_ppl: {where} has {len(ids)} token(s); a perplexity needs at least 2')
        if len(ids) >= session_len:
            raise ValueError(f'get_ppl: {where} has {len(ids)} tokens; session_len is {session_len}')
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f'get_ppl: {where} holds token id {bad}, outside the vocabulary [0, {vocab_size})')


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

    def __init__(self, session_id: int, index: int, choice: int = 0):
        self.resp = Response(text='', generate_token_len=0, input_token_len=0, session_id=session_id, index=index,
                             choice=choice)
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
        if r.finish_reason == 'length' and r.refused:  # a prompt over session_len: refused, not cut short
            r.finish_reason = 'error'
        if out.logprobs:
            r.logprobs = (r.logprobs or []) + out.logprobs
        if out.prompt_logprobs is not None:
            r.prompt_logprobs = (r.prompt_logprobs or []) + out.prompt_logprobs
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
        self._closing = threading.Lock()  # a call is submitted either before close() begins or not at all
        close_at_exit(self)

    # -------------------------------------------------------------- helpers
    def _check_open(self):
        if self._closed:
            raise RuntimeError(_CLOSED)

    def _submit(self, coro) -> concurrent.futures.Future:
        with self._closing:
            if self._closed:
                coro.close()
                raise RuntimeError(_CLOSED)
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _result(self, future: concurrent.futures.Future):
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if self._closed:  # close() (another thread, or exit) cancelled what still ran
                raise RuntimeError(_CLOSED) from None
            raise
        except BaseException:  # e.g. Ctrl-C in the caller: what it started stops too
            future.cancel()
            raise

    def _run(self, coro):
        return self._result(self._submit(coro))

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
                   choice: int = 0, **kwargs) -> Response:
        session_id = kwargs.pop('session_id', None) or self.gateway.next_session_id()
        acc = _Accumulator(session_id, index, choice)
        if _is_token_ids(prompt):
            prompt, kwargs['input_ids'] = None, prompt
        kwargs.setdefault('stream_text', sink is not None)
        async for out in self.gateway.generate(prompt, session_id, gen, do_preprocess=do_preprocess, **kwargs):
            resp = acc.add(out)
            if sink is not None:
                piece = Response(text=out.text, generate_token_len=resp.generate_token_len,
                                 input_token_len=resp.input_token_len, session_id=session_id,
                                 finish_reason=resp.finish_reason, token_ids=list(out.token_ids),
                                 logprobs=out.logprobs, logits=out.logits, last_hidden_state=out.last_hidden_state,
                                 index=index, error=out.error, choice=choice,
                                 prompt_logprobs=out.prompt_logprobs)
                _log_refused(piece)  # (a streaming caller gets it as a Response: said once in the log too)
                sink(piece)
        return acc.result()

    def _samples(self, items, gens) -> List[_Sample]:
        return _expand(items, gens)

    async def _run_samples(self, samples: List[_Sample], do_preprocess: bool, order: Sequence[int], sink=None,
                           on_done=None) -> List[Response]:
        """Every sample, submitted in ``order``; a sample with ``after`` starts once that one has output."""
        started = [asyncio.Event() for _ in samples]
        leaders = {s.after for s in samples if s.after is not None}

        async def one(k):
            s = samples[k]
            try:
                if s.after is not None:
                    await started[s.after].wait()
                wrapped = sink
                if k in leaders:  # streamed, so that its first output comes when its prompt is cached
                    def wrapped(piece, _k=k):
                        started[_k].set()
                        if sink is not None:
                            sink(piece)
                resp = await self._one(s.prompt, s.gen, s.index, do_preprocess, sink=wrapped, choice=s.choice,
                                       stream_text=sink is not None or k in leaders,
                                       share_prompt=s.after is not None or k in leaders)
            finally:
                started[k].set()
            if on_done is not None:
                on_done()
            return resp

        done = await _gather_or_cancel(one(k) for k in order)
        responses: List[Any] = [None] * len(samples)
        for k, resp in zip(order, done):
            responses[k] = resp
        return responses

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
        self._check_open()
        items, single = normalize_prompts(prompts)
        gens = self._gen_configs(gen_config, len(items))
        samples = self._samples(items, gens)
        order = _longest_first([x.gen for x in samples])

        async def run_all():
            bar = None
            if use_tqdm:
                from tqdm import tqdm
                bar = tqdm(total=len(samples), desc='generating')
            try:
                return await self._run_samples(samples, do_preprocess, order,
                                               on_done=bar.update if bar is not None else None)
            finally:
                if bar is not None:
                    bar.close()

        responses = self._run(run_all())
        results = _group(items, gens, samples, responses)
        _raise_refused(responses, single, len(items), results)
        return results[0] if single else results

    def stream_infer(self, prompts: Prompts, gen_config=None, do_preprocess: bool = True,
                     **kwargs) -> Iterator[Response]:
        """Yield increments (``Response.text`` holds the new text; ``index``
        says which prompt, ``choice`` which of its n samples) as they are
        produced."""
        _reject_unknown('stream_infer', kwargs)
        self._check_open()
        items, _ = normalize_prompts(prompts)
        gens = self._gen_configs(gen_config, len(items))
        samples = self._samples(items, gens)
        q: queue.Queue = queue.Queue()
        future = self._submit(self._run_samples(samples, do_preprocess, range(len(samples)), sink=q.put))
        future.add_done_callback(lambda _: q.put(_DONE))  # also when cancelled before it ran
        try:
            while (item := q.get()) is not _DONE:
                yield item
            self._result(future)
        finally:
            if not future.done():  # the caller stopped early: cancel what still runs
                future.cancel()

    def chat(self, prompt: Union[str, List[Dict[str, Any]]], session: Optional[Session] = None,
             gen_config: Optional[GenerationConfig] = None, stream_response: bool = False,
             **kwargs) -> Union[Session, Iterator[Response]]:
        """One turn of a multi-turn chat. The session's KV cache stays in the
        engine, so earlier turns are not prefilled again."""
        _reject_unknown('chat', kwargs)
        self._check_open()
        if session is None:
            session = Session(self.gateway.next_session_id())
        messages = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else list(prompt)
        first = session.step == 0
        gen = gen_config or GenerationConfig()
        if isinstance(gen, GenerationConfig) and gen.n > 1:
            raise ValueError('chat() holds one conversation: GenerationConfig.n must be 1 (infer and '
                             'stream_infer take n > 1)')

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
            _raise_refused([resp], True, 1)
            record(resp)
            return session

        def stream():
            q: queue.Queue = queue.Queue()
            future = self._submit(turn(sink=q.put))
            future.add_done_callback(lambda _: q.put(_DONE))
            try:
                while (item := q.get()) is not _DONE:
                    yield item
                record(self._result(future))
            finally:
                if not future.done():
                    future.cancel()

        return stream()

    def end_session(self, session: Union[Session, int]):
        """Free an interactive session's cache."""
        self._check_open()
        self.gateway.end_session(session.session_id if isinstance(session, Session) else session)

    def get_ppl(self, input_ids: Union[List[int], List[List[int]]]) -> List[float]:
        """Mean cross-entropy of each token sequence (transformers' loss). The whole batch is checked first:
        one bad sequence raises before any runs."""
        self._check_open()
        if not isinstance(input_ids, (list, tuple)) or not input_ids:
            raise ValueError('get_ppl: input_ids must be a non-empty list of token ids, or a list of those')
        batch = [input_ids] if isinstance(input_ids[0], int) else input_ids
        check_ppl_inputs(batch, self.engine.model_config.vocab_size, self.engine.session_len)
        gen = GenerationConfig(max_new_tokens=1)

        async def one(ids: Sequence[int]) -> float:
            loss = None
            async for out in self.gateway.generate(None, self.gateway.next_session_id(), gen, input_ids=list(ids),
                                                   prompt_loss=True):
                if out.error:
                    raise ValueError(out.error)
                loss = out.prompt_loss if out.prompt_loss is not None else loss
            return loss

        return self._run(_gather_or_cancel(one(ids) for ids in batch))

    def close(self):
        """Stop the engine (requests still running end as aborted) and the loop; later calls raise."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        try:
            self.gateway.close()
        finally:
            self._stop_loop()

    def _stop_loop(self):
        """Cancel what still runs on the loop (its callers' futures end as cancelled, so no caller waits
        forever), then stop the loop and its thread."""
        loop = self._loop

        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)

        if threading.current_thread() is self._thread:  # closed from a callback on the loop itself
            for t in asyncio.all_tasks(loop):
                t.cancel()
            loop.call_soon(loop.stop)
            return
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=10)
        except Exception:  # (timed out: stop it all the same)
            logger.warning('the pipeline loop did not wind down in time')
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if sys.is_finalizing():  # too late to stop threads cleanly (at_exit closed it already)
            return
        try:
            self.close()
        except Exception:
            pass
