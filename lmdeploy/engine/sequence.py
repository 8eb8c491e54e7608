"""Requests as the engine sees them: token ids, sampling settings, KV blocks."""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .grammar import GrammarSpec


@dataclass
class SamplingParams:
    """Engine-level sampling settings: everything already turned into ids.
    Not to be changed once the request is submitted (the engine caches what
    it derives from them)."""
    max_new_tokens: int = 512
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0  # OpenAI's, over generated tokens
    presence_penalty: float = 0.0
    logit_bias: Dict[int, float] = field(default_factory=dict)  # token id -> added to its score
    seed: int = 0
    stop_token_ids: List[int] = field(default_factory=list)  # eos included unless ignore_eos
    bad_token_ids: List[int] = field(default_factory=list)
    bad_sequences: List[List[int]] = field(default_factory=list)  # multi-token bad words
    min_new_tokens: int = 0
    logprobs: Optional[int] = None
    output_logits: Optional[str] = None  # 'generation' | 'all'
    output_last_hidden_state: Optional[str] = None
    logits_processors: List[Callable] = field(default_factory=list)
    prompt_loss: bool = False  # get_ppl: report the prompt's cross-entropy, generate nothing
    prompt_logprobs: Optional[int] = None  # each prompt token's logprob and this many alternatives
    grammar: Optional[GrammarSpec] = None  # structured output (engine/grammar.py)
    # one of n samples of a prompt: its full prompt blocks are shared with the others through the block
    # manager's keyed blocks, even where prefix caching is off (n > 1 prefills the prompt once)
    share_prompt: bool = False

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """An argmax of the raw logits, nothing else read or reported (most
        requests): such rows skip the sampler's per-request checks."""
        return (self.greedy and not self.logits_processors and self.repetition_penalty == 1.0
                and not self.penalised and not self.logit_bias and self.grammar is None and not self.bad_token_ids and not self.bad_sequences
                and not (self.min_new_tokens and self.stop_token_ids) and self.logprobs is None
                and not self.output_logits and not self.output_last_hidden_state)

    @functools.cached_property
    def penalised(self) -> bool:
        """Whether OpenAI's frequency or presence penalty applies (they read the generated tokens)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @functools.cached_property
    def needs_all_rows(self) -> bool:
        """Whether every prompt position's output is wanted (no prefix reuse)."""
        return (self.prompt_loss or self.prompt_logprobs is not None or self.output_logits == 'all'
                or self.output_last_hidden_state == 'all')

    @functools.cached_property
    def score_only(self) -> bool:
        """The prompt is run for its outputs (get_ppl, prompt logprobs) and nothing is generated."""
        return self.prompt_loss or self.max_new_tokens == 0


@dataclass
class EngineOutput:
    """What one step produced for one request (delivered incrementally)."""
    new_token_ids: List[int]
    finished: bool = False
    finish_reason: Optional[str] = None  # 'stop' | 'length' | 'error' | 'abort'
    num_prompt_tokens: int = 0
    logprobs: Optional[List[dict]] = None
    logits: Any = None  # tensor [n, V] (cpu) when asked
    last_hidden_state: Any = None
    prompt_loss: Optional[float] = None  # mean cross-entropy over the prompt
    # per prompt token, in order: {token: logprob} with the alternatives (None for the first token)
    prompt_logprobs: Optional[List[Optional[dict]]] = None
    # the stop token that ended the request and its logprobs entry, where logprobs were asked for: it is
    # not one of the reported tokens, but a client that scores text (echo) reads its logprob
    stop_token: Optional[Tuple[int, dict]] = None
    error: Optional[str] = None
    # turned away for something in the request (too long, empty, a busy session): the caller's to fix; an
    # error without it is the engine's own failure
    refused: bool = False

    def absorb(self, later: 'EngineOutput') -> 'EngineOutput':
        """Append ``later`` to this output in place (its status wins): held
        outputs of a non-streaming request grow without copying."""
        import torch
        self.new_token_ids.extend(later.new_token_ids)
        for name in ('logprobs', 'prompt_logprobs'):
            theirs = getattr(later, name)
            if theirs is not None:
                if getattr(self, name) is None:
                    setattr(self, name, [])
                getattr(self, name).extend(theirs)
        for name in ('logits', 'last_hidden_state'):
            mine, theirs = getattr(self, name), getattr(later, name)
            if theirs is not None:
                setattr(self, name, theirs if mine is None else torch.cat([mine, theirs]))
        self.finished, self.finish_reason, self.error = later.finished, later.finish_reason, later.error
        self.refused = later.refused
        self.num_prompt_tokens, self.prompt_loss = later.num_prompt_tokens, later.prompt_loss
        self.stop_token = later.stop_token or self.stop_token
        return self


class SeqStatus(enum.Enum):
    WAITING = 'waiting'  # queued, nothing (or nothing any more) in the cache
    RUNNING = 'running'  # holds blocks, being prefilled or decoded
    IDLE = 'idle'  # interactive session between turns: keeps its blocks
    FINISHED = 'finished'


class Sequence:
    """One request's tokens and cache state.

    ``token_ids`` is the whole context (earlier turns, prompt, generated);
    the first ``num_computed`` of them have their K/V in ``block_ids``.
    """

    def __init__(self, seq_id: int, session_id: int, token_ids: List[int], params: SamplingParams,
                 on_output: Callable[[EngineOutput], None], max_len: int):
        self.seq_id = seq_id
        self.session_id = session_id
        self.token_ids: List[int] = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.on_output = on_output
        self.max_len = max_len  # session_len: context never grows past it
        self.num_computed = 0
        self.block_ids: List[int] = []
        self.block_keys: List[Any] = []  # prefix-cache keys of the full blocks, in order
        self.status = SeqStatus.WAITING
        self.num_generated = 0
        self.finish_reason: Optional[str] = None
        self.loss_sum = 0.0  # get_ppl
        self.loss_count = 0
        self.num_reported = 0  # prompt positions whose logits/hidden states were delivered
        self.turn_start = 0  # where this turn's prompt begins in token_ids (interactive sessions)
        self.interactive = False
        self.stream = True  # False: outputs are held and delivered merged at the end
        self.held: Optional[EngineOutput] = None
        self.matcher = None  # the grammar's state (structured output), made by the engine

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed

    # A sampled token whose value is still on the device is held in
    # ``token_ids`` as a placeholder ``-1 - row`` (its row in the step in
    # flight), so the next step can be scheduled before it is read back.
    # At most the last token is unresolved.
    @property
    def unresolved(self) -> bool:
        return bool(self.token_ids) and self.token_ids[-1] < 0

    @property
    def num_resolved(self) -> int:
        return self.num_tokens - 1 if self.unresolved else self.num_tokens

    @property
    def sampling_done(self) -> bool:
        """Whether the last sampled token was the last allowed one (by length)."""
        return self.num_generated >= self.params.max_new_tokens or self.num_tokens >= self.max_len

    @property
    def final_token_in_flight(self) -> bool:
        """Its last allowed token is sampled but not read back: nothing is left to run."""
        return self.unresolved and self.sampling_done

    def start_turn(self, new_ids: List[int], params: SamplingParams, on_output, max_len: int):
        """Continue an interactive session with a new prompt; the cache stays."""
        self.token_ids.extend(new_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.on_output = on_output
        self.max_len = max_len
        self.num_generated = 0
        self.finish_reason = None
        self.loss_sum, self.loss_count = 0.0, 0
        self.num_reported = self.turn_start = self.num_tokens - len(new_ids)
        self.status = SeqStatus.WAITING
