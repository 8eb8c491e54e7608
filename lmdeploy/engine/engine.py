"""The engine: a background loop that schedules, runs and samples.

Callers on any thread ``submit`` requests and get ``EngineOutput``s through
their callback (called on the engine thread, so it must be quick). All
engine state is touched only by the loop (or under its lock).

The engine keeps the loop, the commands (add, cancel, end), the step's run,
sampling and the outputs; the scheduler keeps the sequences' cache state: the
engine hands it each launched step (``Scheduler.postprocess``) and says how a
request ends (``park`` / ``finish`` / ``end_session``, ``resume`` for a next
turn). What the frontend may use of an engine is ``protocol.EngineLike``.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from lmdeploy.at_exit import close_at_exit
from lmdeploy.devices import get_device
from lmdeploy.devices.layers import check_model_format
from lmdeploy.messages import PytorchEngineConfig

from .block_manager import BlockManager
from .model_config import ModelConfig, load_model_config
from .parallel import start_workers
from .rank import build_rank
from .sampler import NO_TOKEN, reports_more_than_ids, sample_tokens, score_rows, token_logprobs
from .scheduler import ScheduledBatch, Scheduler
from .sequence import EngineOutput, SamplingParams, SeqStatus, Sequence
from .transfer import to_device

logger = logging.getLogger('lmdeploy')

_STOP_TIMEOUT_S = 10.0  # for the loop to finish its step and abort what runs


@dataclass
class EngineRequest:
    session_id: int
    token_ids: List[int]
    params: SamplingParams
    on_output: Callable[[EngineOutput], None]
    # keep the session's cache after this turn (interactive chat)
    interactive: bool = False
    # False: deliver one merged output when the request finishes (no per-token traffic)
    stream: bool = True


@dataclass
class EngineStats:
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_idle_sessions: int
    num_preemptions: int
    num_prefix_hit_tokens: int
    num_generated_tokens: int
    extra: Dict = field(default_factory=dict)
    quant_policy: int = 0  # of the KV cache


@dataclass
class _Sampled:
    """Tokens drawn for ``seqs`` (row i for seqs[i]), possibly still on the
    device: ``read`` waits for them and returns the host copy."""
    seqs: List[Sequence]
    tokens: torch.Tensor
    read: Callable[[], torch.Tensor]
    extras: Optional[Dict[int, dict]] = None  # the step's prompt-wide outputs, by seq_id
    fill: Optional[Callable[[], None]] = None  # completes ``extras`` once the device has scored the prompts


class Engine:

    def __init__(self, model_path: str, config: Optional[PytorchEngineConfig] = None,
                 model_config: Optional[ModelConfig] = None, on_loop: Optional[Callable[[], None]] = None):
        """``model_config``: the checkpoint's config.json already read (else read here).
        ``on_loop``: called on the engine thread after each pass of its loop (a step, or commands handled),
        e.g. to send the outputs the pass made in one message."""
        self.config = config = config or PytorchEngineConfig()
        self.model_path = model_path
        self._grammars = None  # structured output: made on the first request with a grammar
        self.device = get_device(config.device_type)
        self.runtime = self.device.runtime  # its services: step marks, copies to the host
        self.model_config: ModelConfig = model_config or load_model_config(model_path)
        check_model_format(config.model_format, self.model_config.raw.get('quantization_config'),
                           os.path.join(model_path, 'config.json'))
        self.block_size = config.block_size
        self.quant_policy = config.quant_policy
        # tp > 1: this process is rank 0 of the tensor-parallel ranks; the others start now and build alongside
        self.workers = start_workers(model_path, config, self.model_config, self.device) if config.tp > 1 else None
        try:
            rank = build_rank(model_path, config, self.model_config, self.device)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise
        self.plan = plan = rank.plan  # what was agreed at start-up, read here once
        self.model, self.dtype, self.kv_spec, self.num_blocks = rank.model, plan.dtype, plan.kv_spec, plan.num_blocks
        self.session_len, self.max_batch_size = plan.session_len, plan.max_batch_size
        logger.info('KV cache: %d blocks of %d tokens = %d tokens (quant_policy %d, %.1f MiB per block over %d layers)',
                    self.num_blocks, self.block_size, self.num_blocks * self.block_size, self.quant_policy,
                    rank.bytes_per_block / (1 << 20), self.model_config.num_layers)
        prefix = config.enable_prefix_caching
        if prefix and self.model_config.rope.type == 'dynamic':
            logger.warning('prefix caching is off: dynamic NTK rotary makes cached keys depend on length')
            prefix = False
        self.block_manager = BlockManager(self.num_blocks, self.block_size, prefix)
        # the runner: this process's own, or one that has the other ranks run each step along with it
        self.runner = rank.runner if self.workers is None else self.workers.driver(rank.runner)
        self.scheduler = Scheduler(self.block_manager, self.max_batch_size, config.max_prefill_token_num,
                                   self._finish_too_long, mix_prefill_decode=plan.mix_prefill_decode,
                                   prefill_interval=config.prefill_interval,
                                   mixed_step_limit=self.runner.recorded_step_limit(),
                                   kv_window=self.model.kv_window())
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.RLock()
        self._active: Dict[int, Sequence] = {}  # session_id -> waiting/running sequence
        self._next_seq_id = 0
        self._num_generated = 0
        # per phase ('prefill': any step with prompt rows, 'decode'): steps, sequences, tokens, host seconds
        # in the step call, device seconds (from the device's marks: host time includes waiting for the
        # step before, as the host runs a step ahead)
        self._step_stats = {p: [0, 0, 0, 0.0, 0.0] for p in ('prefill', 'decode')}
        self._step_marks: Deque[Tuple[list, Any, Any]] = deque()  # (phase stats, start, end) not yet timed
        self._stopping = False
        # the step whose sampled tokens are not read back yet: the next step is
        # launched first, so the host's bookkeeping overlaps the device's work
        self._inflight: Optional[_Sampled] = None
        self._on_loop = on_loop
        # The engine thread waits on the device with the GIL released; when the
        # wait ends it must get the GIL back quickly from threads that are
        # detokenizing, not after Python's default 5 ms switch interval.
        if sys.getswitchinterval() > 0.001:
            sys.setswitchinterval(0.001)
        # Everything alive now (model, tokenizer, graphs) lives as long as the
        # engine: keep it out of the cyclic collector's full passes, which
        # otherwise pause a decode step for milliseconds now and then.
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # let interpreter shutdown collect them as usual
        self._thread = threading.Thread(target=self._loop, name='lmdeploy-engine', daemon=True)
        self._thread.start()
        close_at_exit(self)  # a program that never calls close() still stops the loop and the workers
        if config.warmup if config.warmup is not None else plan.replays_steps:
            from .warmup import warm_up
            try:
                warm_up(self)
            except BaseException:
                self.close()
                raise

    # ----------------------------------------------------------- public API
    def submit(self, req: EngineRequest):
        """Queue a request (thread-safe). Output arrives via its callback."""
        self._inbox.put(('add', req))

    def cancel(self, session_id: int):
        self._inbox.put(('cancel', session_id))

    def end_session(self, session_id: int):
        """Forget an interactive session and free its cache."""
        self._inbox.put(('end', session_id))

    def stats(self) -> EngineStats:
        with self._lock:
            self._time_steps()
            s = self.scheduler
            return EngineStats(num_blocks=self.num_blocks, block_size=self.block_size,
                               num_free_blocks=self.block_manager.num_free, num_running=len(s.running),
                               num_waiting=len(s.waiting), num_idle_sessions=len(s.idle),
                               num_preemptions=s.num_preemptions,
                               num_prefix_hit_tokens=self.block_manager.num_prefix_hits,
                               num_generated_tokens=self._num_generated, quant_policy=self.quant_policy,
                               extra={f'{p}_{k}': v for p, vals in self._step_stats.items()
                                      for k, v in zip(('steps', 'seqs', 'tokens', 'seconds', 'device_seconds'), vals)})

    def reset_counters(self):
        """Zero the statistics (steps, generated tokens, prefix hits, preemptions): after the warm-up."""
        with self._lock:
            self._time_steps()
            self._step_stats = {p: [0, 0, 0, 0.0, 0.0] for p in ('prefill', 'decode')}
            self._num_generated = 0
            self.scheduler.reset_counters()

    def check_invariants(self):
        """Assert that every KV block is free or owned, counts consistent."""
        with self._lock:
            self.scheduler.check_invariants()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until nothing is queued or running (for tests and shutdown)."""
        done = threading.Event()
        self._inbox.put(('barrier', done))
        return done.wait(timeout)

    def is_alive(self) -> bool:
        """True while the engine accepts and runs requests."""
        return (not self._stopping and self._thread.is_alive()
                and (self.workers is None or self.workers.error() is None))

    @property
    def device_name(self) -> str:
        return self.device.name

    def why_stopped(self) -> Optional[str]:
        """Why the engine stopped running steps without being closed (None while it runs, or once closed)."""
        if self._stopping:
            return None
        if self.workers is not None and self.workers.error():
            return self.workers.error()
        return None if self._thread.is_alive() else 'the engine loop stopped'

    def close(self):
        if not self._stopping:
            self._stopping = True
            self._inbox.put(('stop', None))
            if self._thread is not threading.current_thread():  # (an output callback may close the engine)
                self._thread.join(timeout=_STOP_TIMEOUT_S)
                if self._thread.is_alive():
                    logger.warning('the engine loop did not stop within %.0f s', _STOP_TIMEOUT_S)
            if self.workers is not None:
                self.workers.close()
            # what was frozen at start-up (this engine's model and cache among it) is collectable again:
            # frozen objects in reference cycles would otherwise outlive the engine (a process that makes
            # several engines, e.g. a test run, would keep every one's KV cache)
            gc.unfreeze()

    # ----------------------------------------------------------------- loop
    def _loop(self):
        barriers: List[threading.Event] = []
        while True:
            block = not self._busy()
            try:
                while True:
                    cmd, arg = self._inbox.get(block=block, timeout=None if block else 0)
                    block = False
                    if cmd == 'stop':
                        self._abort_all()
                        self._after_pass()
                        return
                    if cmd == 'barrier':
                        barriers.append(arg)
                        continue
                    with self._lock:
                        getattr(self, f'_on_{cmd}')(arg)
            except queue.Empty:
                pass
            except Exception:  # a bug in handling one command must not stop the loop
                logger.exception('engine command failed')
            stalled = False
            with self._lock:
                if self._inflight is not None and not self.scheduler.can_run_ahead():
                    self._resolve_inflight()
                batch = ScheduledBatch([], [])
                if self.scheduler.has_work():
                    try:
                        batch = self.scheduler.schedule()
                    except Exception as e:
                        logger.exception('scheduling failed')
                        self._fail_all(f'{type(e).__name__}: {e}')
                if batch.seqs:
                    self._run_step(batch)
                elif self._inflight is not None:
                    self._resolve_inflight()
                else:
                    stalled = True
                busy = self._busy()
            self._after_pass()
            if stalled and busy:  # nothing fits right now: do not spin
                time.sleep(0.001)
            if not busy:
                for ev in barriers:
                    ev.set()
                barriers.clear()

    def _after_pass(self):
        if self._on_loop is not None:
            try:
                self._on_loop()
            except Exception:
                logger.exception('the engine loop hook failed')

    def _busy(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def _run_step(self, batch: ScheduledBatch):
        stats = self._step_stats['decode' if batch.is_decode else 'prefill']
        start = time.perf_counter()
        mark = self.runtime.timestamp()
        prev = self._inflight
        try:
            with torch.inference_mode():
                self._step(batch)
        except Exception as e:  # a failed step must not take the engine down
            logger.exception('engine step failed')
            failed = list(batch.seqs)  # with the step it consumed and any it left in flight
            for pending in (prev, self._inflight):
                if pending is not None:
                    failed += pending.seqs
            self._inflight = None
            self._fail_unfinished(failed, e)
        stats[0] += 1
        stats[1] += len(batch.seqs)
        stats[2] += sum(batch.num_new_tokens)
        stats[3] += time.perf_counter() - start
        self._step_marks.append((stats, mark, self.runtime.timestamp()))
        self._time_steps()

    def _time_steps(self):
        """Add the device time of the steps the device has finished."""
        while self._step_marks:
            stats, start, end = self._step_marks[0]
            seconds = self.runtime.seconds_between(start, end)
            if seconds is None:
                break
            stats[4] += seconds
            self._step_marks.popleft()

    def _grammar_set(self):
        """The grammars of this model's tokenizer (loaded once, on the first constrained request)."""
        if self._grammars is None:
            from lmdeploy.tokenizer import load_tokenizer

            from .grammar import Grammars
            self._grammars = Grammars(load_tokenizer(self.model_path, self.config.trust_remote_code),
                                      self.model_config.vocab_size)
        return self._grammars

    # ------------------------------------------------------------- commands
    def _on_add(self, req: EngineRequest):
        params = req.params
        idle = self.scheduler.idle_session(req.session_id)
        history = idle.num_tokens if idle is not None else 0
        total = history + len(req.token_ids)
        error = None
        if req.session_id in self._active:
            error = 'error', f'session {req.session_id} is busy with another request'
        elif not req.token_ids:
            error = 'error', 'the prompt is empty'
        elif total >= self.session_len:
            error = 'length', (f'the prompt has {total} tokens (with {history} from earlier turns); session_len '
                               f'is {self.session_len} and prompt plus output must fit in it')
        elif params.prompt_loss and total < 2:
            error = 'error', 'get_ppl needs at least 2 tokens'
        refused = error is not None  # for something in the request: the caller's to fix
        matcher = None
        if error is None and params.grammar is not None:
            try:
                matcher = self._grammar_set().matcher(params.grammar)
            except Exception as e:  # (the frontend compiled it already: not expected, the engine's fault)
                error = 'error', str(e)
        if error is not None:  # turned away at the door; an idle session stays as it was
            req.on_output(EngineOutput([], True, error[0], num_prompt_tokens=total, error=error[1], refused=refused))
            return
        seq = self.scheduler.resume(req.session_id)
        if seq is not None:
            seq.start_turn(req.token_ids, params, req.on_output, self.session_len)
        else:
            seq = Sequence(self._next_seq_id, req.session_id, req.token_ids, params, req.on_output,
                           self.session_len)
            self._next_seq_id += 1
        seq.interactive = req.interactive
        seq.stream = req.stream
        seq.matcher = matcher
        seq.held = None
        self._active[seq.session_id] = seq
        self.scheduler.add(seq)

    def _on_cancel(self, session_id: int):
        seq = self._active.get(session_id)
        if seq is not None:
            self._finish(seq, 'abort')

    def _on_end(self, session_id: int):
        seq = self._active.get(session_id)
        if seq is not None:
            seq.interactive = False
            self._finish(seq, 'abort')
        self.scheduler.end_session(session_id)

    def _abort_all(self):
        with self._lock:
            self._inflight = None
            for seq in list(self._active.values()):
                self._finish(seq, 'abort', error='the engine is shutting down')

    def _fail_unfinished(self, seqs: List[Sequence], e: Exception):
        for seq in seqs:
            if seq.status != SeqStatus.FINISHED:
                self._finish(seq, 'error', error=f'{type(e).__name__}: {e}')

    def _fail_all(self, error: str):
        self._inflight = None
        for seq in list(self._active.values()):
            seq.interactive = False
            self._finish(seq, 'error', error=error)

    def _finish_too_long(self, seq: Sequence, why: str):
        seq.interactive = False  # (the scheduler let it go already: nothing to keep)
        self._finish(seq, 'length', error=why)

    # ---------------------------------------------------------------- steps
    def _finish(self, seq: Sequence, reason: str, error: Optional[str] = None,
                output: Optional[EngineOutput] = None):
        """End the request: an interactive session is parked with its cache (not after an error), any
        other sequence's blocks are freed; the final output goes out."""
        self._active.pop(seq.session_id, None)
        if seq.interactive and reason != 'error':
            self.scheduler.park(seq)
        else:
            self.scheduler.finish(seq)
        seq.finish_reason = reason
        out = output or EngineOutput([])
        out.finished, out.finish_reason, out.error = True, reason, error
        out.num_prompt_tokens = seq.num_prompt_tokens
        if seq.params.prompt_loss and seq.loss_count:
            out.prompt_loss = seq.loss_sum / seq.loss_count
        self._emit(seq, out)

    def _step(self, batch: ScheduledBatch):
        prev, self._inflight = self._inflight, None
        hidden = self.runner.forward(batch, prev.tokens if prev is not None else None)
        starts, done = self.scheduler.postprocess(batch)
        if prev is not None:  # the device runs this step while the host settles the previous one
            self._resolve(prev)
        extras, fill = self._prompt_outputs(batch, hidden, starts)
        for seq, _ in done:
            if seq.params.score_only:  # get_ppl, prompt logprobs: the whole prompt is scored, nothing generated
                self._finish(seq, 'length', output=self._with_extra(EngineOutput([]), extras.get(seq.seq_id)))
        # a sequence that stopped (or was cancelled) at the previous step computed one wasted row here
        done = [(s, r) for s, r in done if not s.params.score_only and s.status == SeqStatus.RUNNING]
        if done:
            self._sample(done, hidden, extras, fill)

    def _prompt_outputs(self, batch: ScheduledBatch, hidden: torch.Tensor,
                        starts: List[int]) -> Tuple[Dict[int, dict], Optional[Callable[[], None]]]:
        """Prompt-wide outputs (get_ppl losses, prompt logprobs, 'all' logits and hidden states) by seq_id,
        and, where the prompts' scores can wait for the step's sampled tokens, what completes them then.
        Chunks of a prompt still being prefilled are streamed right away."""
        extras: Dict[int, dict] = {}
        scored = []  # (seq, its extra, hidden rows, targets): scored together below
        for seq, n, start in zip(batch.seqs, batch.num_new_tokens, starts):
            p = seq.params
            if not p.needs_all_rows:
                continue
            # prompt positions first..last-1 are new here (a recompute after preemption repeats none)
            first = max(seq.num_computed - n, seq.num_reported)
            last = min(seq.num_computed, seq.num_prompt_tokens)
            if first >= last:
                continue
            offset = start + first - (seq.num_computed - n)
            chunk = hidden[offset:offset + (last - first)]
            seq.num_reported = last
            extra = extras.setdefault(seq.seq_id, {})
            if p.output_last_hidden_state == 'all':
                extra['hidden'] = chunk.float().cpu()
            if p.output_logits == 'all':
                extra['logits'] = self.runner.logits(chunk, range(offset, offset + len(chunk))).float().cpu()
            if p.prompt_loss or p.prompt_logprobs is not None:
                # position j's logits predict token j + 1; the last prompt position's, the first generated one
                targets = seq.token_ids[first + 1:min(last + 1, seq.num_prompt_tokens)]
                if p.prompt_logprobs is not None and first == seq.turn_start:
                    extra['prompt_logprobs'] = [None]  # a turn's first prompt token gets none
                scored.append((seq, extra, range(offset, offset + len(targets)), targets))
        fill = self._score_prompts(hidden, scored) if scored else None
        if fill is not None and any(seq.params.score_only or seq.num_pending > 0 for seq, *_ in scored):
            fill()  # a prompt finishes here, or a chunk of it streams: its scores go out now
            fill = None
        for seq in batch.seqs:
            extra = extras.get(seq.seq_id)
            if extra and seq.num_pending > 0:
                self._emit(seq, EngineOutput([], logits=extra.get('logits'), last_hidden_state=extra.get('hidden'),
                                             prompt_logprobs=extra.get('prompt_logprobs')))
        return extras, fill

    def _score_prompts(self, hidden: torch.Tensor, scored) -> Callable[[], None]:
        """Queue the scoring of every prompt chunk in the step (get_ppl's losses, prompt logprobs) in one pass
        over their rows; the returned function waits for it and fills the sequences' extras."""
        index = [r for _, _, rows, _ in scored for r in rows]
        top = max(seq.params.prompt_logprobs or 0 for seq, *_ in scored)
        if index:
            targets = torch.tensor([t for *_, ts in scored for t in ts], dtype=torch.int64)
            picked = self.runner.rows(hidden, index)
            reads = [self.runtime.to_host_async(t) for t in score_rows(
                lambda a, b: self.runner.logits(picked[a:b], index[a:b]), to_device(targets, picked.device), top)]

        def fill():
            chosen, top_ids, top_vals = [r().tolist() for r in reads] if index else ([], [], [])
            at = 0
            for seq, extra, rows, ts in scored:
                p, span = seq.params, range(at, at + len(rows))
                at += len(rows)
                if p.prompt_loss:
                    seq.loss_sum -= sum(chosen[i] for i in span)
                    seq.loss_count += len(span)
                if p.prompt_logprobs is not None:
                    n = p.prompt_logprobs
                    entries = []
                    for i, t in zip(span, ts):
                        entry = dict(zip(top_ids[i][:n], top_vals[i][:n]))
                        entry[t] = chosen[i]
                        entries.append(entry)
                    extra['prompt_logprobs'] = extra.get('prompt_logprobs', []) + entries
        return fill

    def _sample(self, done, hidden: torch.Tensor, extras: Dict[int, dict], fill: Optional[Callable[[], None]]):
        """Draw the next tokens on the device. They stay in flight (read back
        while the next step runs, with the prompt outputs ``extras`` that
        ``fill`` completes); requests whose outputs need this step's tensors
        on the host (logprobs, logits, hidden states) are settled now."""
        seqs = [s for s, _ in done]
        rows = [r for _, r in done]
        last_hidden = self.runner.rows(hidden, rows)
        plain = all(s.params.plain_greedy for s in seqs)
        settle_now = not plain and any(reports_more_than_ids(s) for s in seqs)
        if plain:  # an argmax and nothing else: under tp the logits are never made whole
            logits, tokens = None, self.runner.greedy(last_hidden, rows)
            drawn = tokens
        else:
            logits = self.runner.logits(last_hidden, rows)  # the model's dtype: the sampler takes what it needs
            tokens, drawn = sample_tokens(logits, seqs, self.device, self._grammars)
        for i, seq in enumerate(seqs):
            seq.token_ids.append(-1 - i)
            seq.num_generated += 1
        sampled = _Sampled(seqs, tokens, self.runtime.to_host_async(drawn), extras or None, fill)
        if settle_now:
            self._resolve(sampled, logits, last_hidden, token_logprobs(logits, tokens, seqs))
        else:
            self._inflight = sampled

    def _resolve_inflight(self):
        sampled, self._inflight = self._inflight, None
        try:
            with torch.inference_mode():
                self._resolve(sampled)
        except Exception as e:
            logger.exception('reading sampled tokens failed')
            self._fail_unfinished(sampled.seqs, e)

    def _resolve(self, sampled: _Sampled, logits=None, last_hidden=None, logprobs=None):
        """Put the sampled tokens in place of their placeholders, then stop,
        finish or report each sequence."""
        tokens = sampled.read().tolist()
        if sampled.fill is not None:
            sampled.fill()
        extras = sampled.extras
        plain = logits is None and not extras  # nothing but token ids to report
        for i, (seq, token) in enumerate(zip(sampled.seqs, tokens)):
            if seq.token_ids[-1:] != [-1 - i] or seq.status == SeqStatus.FINISHED:
                continue  # the request ended while its token was in flight
            if token == NO_TOKEN:  # (the placeholder goes with the request)
                self._finish(seq, 'error', error='the engine found no finite logits to draw the next token from '
                             '(NaN or infinite values, or a grammar that allows no token): an engine fault')
                continue
            seq.token_ids[-1] = token
            self._num_generated += 1
            if seq.matcher is not None and not seq.matcher.accept_token(token):
                self._finish(seq, 'error', error=f'the grammar does not allow token {token} here')
                continue
            if (plain and seq.held is not None and token not in seq.params.stop_token_ids and not seq.sampling_done
                    and seq.matcher is None):
                seq.held.new_token_ids.append(token)  # a held (non-streaming) output grows by one token
                continue
            out = self._with_extra(EngineOutput([]), extras.get(seq.seq_id) if extras else None)
            p = seq.params
            # a stop token is not reported (no id, no logprobs), so neither is its row: logits and
            # hidden states stay one row per reported token ('generation'), as in LMDeploy
            stopped = token in p.stop_token_ids or (seq.matcher is not None and seq.matcher.is_terminated())
            if logits is not None and not stopped:
                if p.output_logits == 'generation' or (p.output_logits == 'all' and seq.num_generated > 1):
                    out.logits = logits[i:i + 1].float().cpu()
                if p.output_last_hidden_state == 'generation' or (p.output_last_hidden_state == 'all'
                                                                   and seq.num_generated > 1):
                    out.last_hidden_state = last_hidden[i:i + 1].float().cpu()
            if stopped:
                if logprobs is not None and logprobs[i] is not None:
                    out.stop_token = (token, logprobs[i])
                self._finish(seq, 'stop', output=out)
                continue
            out.new_token_ids = [token]
            if logprobs is not None and logprobs[i] is not None:
                out.logprobs = [logprobs[i]]
            if seq.sampling_done:
                self._finish(seq, 'length', output=out)
            else:
                self._emit(seq, out)

    @staticmethod
    def _emit(seq: Sequence, out: EngineOutput):
        """Deliver an output now, or (non-streaming requests) hold it and
        deliver everything merged when the request finishes."""
        if seq.held is not None:
            out = seq.held.absorb(out)
            seq.held = None
        if seq.stream or out.finished:
            seq.on_output(out)
        else:
            seq.held = out

    @staticmethod
    def _with_extra(out: EngineOutput, extra: Optional[dict]) -> EngineOutput:
        if extra:
            out.logits = extra.get('logits')
            out.last_hidden_state = extra.get('hidden')
            out.prompt_logprobs = extra.get('prompt_logprobs')
        return out
