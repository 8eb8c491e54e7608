"""The async request gateway that the pipeline and the server share.

It turns prompts into token ids (chat template, tokenizer), generation
configs into engine sampling params, and engine outputs back into text
increments: incremental detokenization, stop strings, cancellation.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple, Union

from lmdeploy.engine.engine import Engine, EngineRequest
from lmdeploy.engine.grammar import Grammars, spec_from_response_format
from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.sequence import EngineOutput, SamplingParams
from lmdeploy.messages import REPETITION_PENALTY_BOUNDS, GenerationConfig, PytorchEngineConfig

from .chat_template import ChatTemplateConfig, get_chat_template
from .detokenizer import IncrementalDetokenizer
from .sampling_defaults import load_sampling_defaults

logger = logging.getLogger('lmdeploy')

Prompt = Union[str, List[Dict[str, Any]]]


@dataclass
class GenOut:
    """One increment of a generation, as the gateway streams it."""
    text: str  # new text since the previous increment
    input_token_len: int
    generate_token_len: int  # total so far
    finish_reason: Optional[str] = None
    token_ids: List[int] = field(default_factory=list)  # new ids since the previous increment
    logprobs: Optional[List[Dict[int, float]]] = None
    logits: Any = None
    last_hidden_state: Any = None
    prompt_loss: Optional[float] = None
    error: Optional[str] = None
    refused: bool = False  # the request was turned away for something in it (else an error is the engine's)
    # each prompt token's {token: logprob} (GenerationConfig.prompt_logprobs; None for the first token)
    prompt_logprobs: Optional[List[Optional[Dict[int, float]]]] = None
    # the stop token that ended it and its logprobs entry (with logprobs; not among token_ids)
    stop_token: Optional[Tuple[int, Dict[int, float]]] = None

    def can_absorb(self, later: 'GenOut') -> bool:
        """Whether ``later`` can be folded into this increment: this one is not the last, and neither carries
        per-token tensors (those stay one increment each)."""
        return (self.finish_reason is None and self.logits is None and self.last_hidden_state is None
                and later.logits is None and later.last_hidden_state is None)

    def absorb(self, later: 'GenOut') -> 'GenOut':
        """Append ``later`` to this increment in place (its status wins): a consumer that fell behind sends
        one event for what piled up instead of one per token (see :func:`coalesce_outputs`)."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + later.prompt_logprobs
        self.input_token_len = later.input_token_len or self.input_token_len
        self.generate_token_len = later.generate_token_len
        self.finish_reason, self.error = later.finish_reason, later.error or self.error
        if later.prompt_loss is not None:
            self.prompt_loss = later.prompt_loss
        self.stop_token = later.stop_token or self.stop_token
        return self


def take_pending(first: EngineOutput, queue: asyncio.Queue) -> EngineOutput:
    """``first`` with every output already waiting behind it in ``queue`` folded in (outputs that carry no
    logits or hidden states: the caller folds only those).

    Why: under load the event loop falls behind the engine, and each output
    left on its own costs a detokenization and an SSE event. Folding what
    piled up keeps the work per engine step, not per token, so a server that
    is behind catches up instead of falling further behind."""
    if queue.empty() or first.finished:
        return first
    outs = [first]
    while not queue.empty() and not outs[-1].finished:
        outs.append(queue.get_nowait())
    last = outs[-1]

    def joined(name: str):
        if all(getattr(o, name) is None for o in outs):
            return None
        return [lp for o in outs for lp in (getattr(o, name) or [])]
    return EngineOutput([t for o in outs for t in o.new_token_ids], last.finished, last.finish_reason,
                        last.num_prompt_tokens or first.num_prompt_tokens, logprobs=joined('logprobs'),
                        prompt_loss=last.prompt_loss, error=last.error, prompt_logprobs=joined('prompt_logprobs'),
                        stop_token=last.stop_token)


def check_text(text: str, what: str):
    """Text the tokenizer can encode: a lone surrogate (e.g. from JSON's "\\ud800" or bytes decoded with
    errors='surrogateescape') has no UTF-8 form, and the tokenizer's own error does not say so."""
    try:
        text.encode('utf-8')
    except UnicodeEncodeError as e:
        ch = text[e.start]
        raise ValueError(f'{what} is not valid Unicode text: it holds a lone surrogate (U+{ord(ch):04X}) at '
                         f'character {e.start}, which has no UTF-8 form; send text that is valid UTF-8 (a '
                         'surrogate half is only valid as part of a pair)') from None


class _StopMatcher:
    """Finds the first stop string in the text; holds back a tail that
    might still become one, so a stop string is never streamed half-way."""

    def __init__(self, stop_words: List[str], include: bool):
        self.words = [w for w in stop_words if w]
        self.include = include
        self.hold = max((len(w) for w in self.words), default=1) - 1

    def find(self, text: str, search_from: int) -> Optional[int]:
        """End index of the kept text if a stop word occurs, else None."""
        best = None
        for w in self.words:
            i = text.find(w, max(0, search_from - len(w) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, w)
        if best is None:
            return None
        return best[0] + len(best[1]) if self.include else best[0]

    def safe_end(self, text: str) -> int:
        """How much of the text can be shown while more may follow."""
        if not self.words:
            return len(text)
        for cut in range(max(0, len(text) - self.hold), len(text)):
            tail = text[cut:]
            if any(w.startswith(tail) for w in self.words):
                return cut
        return len(text)


class _Courier:
    """Hands engine outputs (made on the engine thread) to one event loop,
    waking it once per batch of outputs rather than once per output."""
    _by_loop: 'weakref.WeakKeyDictionary' = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: List[tuple] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> '_Courier':
        courier = cls._by_loop.get(loop)
        if courier is None:
            courier = cls._by_loop[loop] = cls(loop)
        return courier

    def deliver(self, queue: asyncio.Queue, out: EngineOutput):
        with self.lock:
            self.pending.append((queue, out))
            if len(self.pending) > 1:  # a flush is already on its way
                return
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the consumer's loop is closed: nobody waits (its cancel is on the way)
            with self.lock:
                self.pending.clear()

    def _flush(self):
        with self.lock:
            items, self.pending = self.pending, []
        for queue, out in items:
            queue.put_nowait(out)


class Gateway:
    """Owns the engine, the tokenizer and the chat template."""

    def __init__(self, model_path: str, backend_config: Optional[PytorchEngineConfig] = None,
                 chat_template_config: Optional[ChatTemplateConfig] = None, model_name: Optional[str] = None,
                 engine_process: bool = False):
        """engine_process: where the engine runs when ``backend_config.engine_process`` is None: in a
        child process (:class:`~lmdeploy.engine.process.EngineProcess`) or on a thread of this one."""
        from lmdeploy.tokenizer import load_tokenizer
        self.model_path = model_path
        self.model_name = model_name or model_path.rstrip('/').split('/')[-1]
        # a directory without config.json fails here with a clear message, not in the tokenizer
        model_config = load_model_config(model_path)
        config = backend_config or PytorchEngineConfig()
        self.tokenizer = load_tokenizer(model_path, config.trust_remote_code)
        self._grammars: Optional[Grammars] = None
        if config.engine_process if config.engine_process is not None else engine_process:
            from lmdeploy.engine.process import EngineProcess
            self.engine = EngineProcess(model_path, config, model_config)
        else:
            self.engine = Engine(model_path, config, model_config)
        self.session_len = self.engine.session_len
        self.chat_template = get_chat_template(chat_template_config, self.tokenizer, model_path=model_path,
                                               model_type=model_config.model_type)
        # what the model's generation_config.json says to sample with (the server's defaults)
        self.sampling_defaults = load_sampling_defaults(model_path)
        self.eos_token_ids = self._eos_ids()
        self._session_ids = itertools.count(1)

    def _eos_ids(self) -> List[int]:
        ids = list(self.engine.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        for word in self.chat_template.stop_words:  # e.g. <|im_end|>, <|eot_id|>
            wid = self.tokenizer.encode(word, add_special_tokens=False)
            if len(wid) == 1 and wid[0] not in ids:
                ids.append(wid[0])
        return ids

    def next_session_id(self) -> int:
        return next(self._session_ids)

    # ------------------------------------------------------------ prompts
    def tool_format(self, name: Optional[str] = None):
        """How this model writes tool calls: ``name`` (a parser's name) or, without one (or 'auto'), from the
        chat template's markers and the model's type (:func:`~lmdeploy.frontend.tool_calls.detect_format`)."""
        from .tool_calls import detect_format, get_format
        if name and name != 'auto':
            return get_format(name)
        hf_text = getattr(getattr(self.chat_template, 'tokenizer', None), 'chat_template', None)
        if not isinstance(hf_text, str):  # a builtin template: its own family's
            return self.chat_template.tool_format
        return detect_format(hf_text, self.engine.model_config.model_type)

    def encode_prompt(self, prompt: Prompt, do_preprocess: bool = True, sequence_start: bool = True,
                      tools: Optional[List[dict]] = None, tool_format=None) -> List[int]:
        """Token ids of a prompt: a string (templated as a user turn unless ``do_preprocess`` is False) or
        messages; ``tools`` (OpenAI tool objects) are described to the model (see
        :meth:`~lmdeploy.frontend.chat_template.ChatTemplate.messages2prompt`)."""
        if isinstance(prompt, str):
            check_text(prompt, 'the prompt')
        if isinstance(prompt, str) and not do_preprocess:
            return self.tokenizer.encode(prompt, add_special_tokens=sequence_start)
        if not isinstance(prompt, (str, list)):
            raise TypeError(f'a prompt is a str or a list of messages, got {type(prompt).__name__}')
        text = self.chat_template.messages2prompt(prompt, sequence_start=sequence_start, tools=tools,
                                                  tool_format=tool_format)
        try:
            check_text(text, 'the templated prompt')
        except ValueError:
            for i, m in enumerate(prompt if isinstance(prompt, list) else []):  # name the message at fault
                content = m.get('content') if isinstance(m, dict) else None
                if isinstance(content, str):
                    check_text(content, f'message {i}\'s content')
            raise
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        if (sequence_start and bos is not None and getattr(self.chat_template, 'add_bos', False)
                and (not ids or ids[0] != bos)):
            ids = [bos] + ids
        return ids

    def sampling_params(self, gen: GenerationConfig) -> SamplingParams:
        gen.validate()
        if gen.n != 1:  # the pipeline and the server expand n into n calls
            raise ValueError(f'GenerationConfig.n={gen.n}: one generate() call makes one sample; '
                             'Pipeline.infer / stream_infer take n > 1')
        grammar = spec_from_response_format(gen.response_format)
        if grammar is not None:
            self.grammars().compile(grammar)  # a spec that cannot compile is refused here, with the reason
        stop_ids = [] if gen.ignore_eos else list(self.eos_token_ids)
        stop_ids += [i for i in (gen.stop_token_ids or []) if i not in stop_ids]
        bad_ids, bad_seqs = list(gen.bad_token_ids or []), []
        for name in ('stop_words', 'bad_words'):
            for word in getattr(gen, name) or []:
                check_text(word, f'GenerationConfig.{name} entry {word!r}')
        for word in gen.bad_words or []:
            ids = self.tokenizer.encode(word, add_special_tokens=False)
            (bad_ids.extend if len(ids) == 1 else bad_seqs.append)(ids)
        vocab = self.engine.model_config.vocab_size
        for name, ids in (('stop_token_ids', gen.stop_token_ids or []), ('bad_token_ids', gen.bad_token_ids or [])):
            if any(i >= vocab for i in ids):
                raise ValueError(f'GenerationConfig.{name} has ids outside the vocabulary (size {vocab})')
        outside = [i for i in (gen.logit_bias or {}) if i >= vocab]
        if outside:
            raise ValueError(f'GenerationConfig.logit_bias: token id {outside[0]} is outside the vocabulary '
                             f'(ids are 0 to {vocab - 1})')
        return SamplingParams(
            max_new_tokens=gen.max_new_tokens,
            greedy=gen.is_greedy,
            temperature=1.0 if gen.is_greedy else gen.temperature,
            top_k=gen.top_k,
            top_p=gen.top_p,
            min_p=gen.min_p,
            repetition_penalty=min(max(gen.repetition_penalty, REPETITION_PENALTY_BOUNDS[0]),
                                   REPETITION_PENALTY_BOUNDS[1]),
            frequency_penalty=float(gen.frequency_penalty),
            presence_penalty=float(gen.presence_penalty),
            logit_bias={int(i): float(b) for i, b in (gen.logit_bias or {}).items() if b != 0.0},
            seed=gen.random_seed if gen.random_seed is not None else random.SystemRandom().randrange(1 << 31),
            stop_token_ids=stop_ids,
            bad_token_ids=bad_ids,
            bad_sequences=bad_seqs,
            min_new_tokens=gen.min_new_tokens or 0,
            logprobs=gen.logprobs,
            prompt_logprobs=gen.prompt_logprobs,
            output_logits=gen.output_logits,
            output_last_hidden_state=gen.output_last_hidden_state,
            logits_processors=list(gen.logits_processors or []),
            grammar=grammar,
        )

    def grammars(self) -> Grammars:
        """Structured output's compiler for this tokenizer (made on first use; xgrammar is optional)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.engine.model_config.vocab_size)
        return self._grammars

    # ----------------------------------------------------------- generate
    async def generate(self, prompt: Optional[Prompt], session_id: int, gen_config: Optional[GenerationConfig] = None,
                       input_ids: Optional[List[int]] = None, do_preprocess: bool = True,
                       sequence_start: bool = True, interactive: bool = False,
                       prompt_loss: bool = False, stream_text: bool = True,
                       share_prompt: bool = False) -> AsyncIterator[GenOut]:
        """Stream GenOut increments; the last one has finish_reason set.

        interactive: the session keeps its KV cache after this turn; the
        next call with the same session_id and sequence_start=False sends
        only the new turn.
        stream_text=False: the caller wants the text only at the end, so
        (without stop words, which need the text as it grows) it is decoded
        once there instead of token by token; the result is the same.
        share_prompt: one of n samples of this prompt; a sample submitted once
        another has output reuses that one's full prompt blocks (prefix
        caching on or off).
        """
        gen = gen_config or GenerationConfig()
        try:
            params = self.sampling_params(gen)
            params.prompt_loss, params.share_prompt = prompt_loss, share_prompt
            ids = input_ids if input_ids is not None else self.encode_prompt(prompt, do_preprocess, sequence_start)
        except (ValueError, TypeError) as e:
            yield GenOut('', 0, 0, finish_reason='error', error=str(e), refused=True)
            return
        outputs: asyncio.Queue = asyncio.Queue()
        courier = _Courier.of(asyncio.get_running_loop())

        def on_output(out: EngineOutput):
            courier.deliver(outputs, out)

        stops = _StopMatcher(gen.stop_words or [], gen.include_stop_str_in_output)
        lazy = not stream_text and not stops.words
        # outputs that piled up are folded into one, unless each must stay apart: a stop string is cut at
        # the output that completes it, and logits / hidden states travel one tensor an output
        foldable = not stops.words and not gen.output_logits and not gen.output_last_hidden_state
        self.engine.submit(EngineRequest(session_id, list(ids), params, on_output, interactive=interactive,
                                         stream=not lazy))
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=gen.skip_special_tokens,
                                       spaces_between_special_tokens=gen.spaces_between_special_tokens)
        text, shown, num_generated = '', 0, 0
        held: List[int] = []  # ids not yet detokenized (lazy mode)
        finished = False
        try:
            while True:
                out: EngineOutput = await outputs.get()
                if foldable:
                    out = take_pending(out, outputs)
                num_generated += len(out.new_token_ids)
                searched = len(text)
                if lazy:
                    held.extend(out.new_token_ids)
                    if out.finished:
                        text += detok.step(held)
                else:
                    text += detok.step(out.new_token_ids)
                reason = out.finish_reason if out.finished else None
                if out.finished:
                    text += detok.finish()
                end = stops.find(text, searched) if stops.words else None
                if end is not None:
                    text, reason = text[:end], 'stop'
                    if not out.finished:
                        self.engine.cancel(session_id)
                        # report the output that completed the stop word (its token ids,
                        # logprobs, logits), not what the engine made before it let go
                        stop_out = out
                        while not out.finished:  # drain until the engine has let go
                            out = await outputs.get()
                        stop_out.finished = True
                        stop_out.num_prompt_tokens = out.num_prompt_tokens or stop_out.num_prompt_tokens
                        out = stop_out
                visible = len(text) if reason else stops.safe_end(text)
                delta = text[shown:visible] if visible > shown else ''
                shown = max(shown, visible)
                yield GenOut(delta, out.num_prompt_tokens or len(ids), num_generated, finish_reason=reason,
                             token_ids=out.new_token_ids, logprobs=out.logprobs, logits=out.logits,
                             last_hidden_state=out.last_hidden_state, prompt_loss=out.prompt_loss,
                             error=out.error, refused=out.refused, prompt_logprobs=out.prompt_logprobs,
                             stop_token=out.stop_token if reason == 'stop' and end is None else None)
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away: free the request's blocks now
                self.engine.cancel(session_id)

    def end_session(self, session_id: int):
        self.engine.end_session(session_id)

    def cancel(self, session_id: int):
        self.engine.cancel(session_id)

    def close(self):
        self.engine.close()
