"""Continuous batching: which sequences run this step, and how many tokens each.

Every step, running sequences go first (one token each when decoding, a
chunk when their prompt is still being prefilled), then waiting ones are
admitted while the batch, the prefill token budget and the free blocks
allow. A step that prefills also carries every sequence ready to decode, and
lists the one-token rows first (attention runs them as a decode batch). When
a running sequence needs a block and none is free, the most recently
admitted running sequence is preempted: its blocks are freed and it is
recomputed later.

The scheduler owns the sequences' cache state: the queues, the idle
interactive sessions and, through its block manager, every block and prefix
key. The engine hands it each step's batch once the step is launched
(``postprocess``: computed tokens, full blocks keyed) and tells it how a
request ends (``park``: an interactive session keeps its blocks between
turns; ``finish``; ``end_session``; ``resume`` for a session's next turn);
nothing else writes its queues or ``idle``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple

from .block_manager import FREED, BlockManager
from .sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    seqs: List[Sequence]
    num_new_tokens: List[int]
    is_decode: bool = field(init=False)  # one new token per sequence (asked several times a step)

    def __post_init__(self):
        self.is_decode = all(n == 1 for n in self.num_new_tokens)


class Scheduler:

    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_prefill_tokens: int,
                 on_too_long: Callable[[Sequence, str], None], mix_prefill_decode: bool = True,
                 prefill_interval: int = 16, mixed_step_limit: Optional[Tuple[int, Optional[int]]] = None,
                 kv_window: Optional[int] = None):
        """mixed_step_limit: (tokens, prompt sequences) that a step carrying decode rows stays within (the
        largest recorded one, where steps are recorded): a burst of prompts is prefilled over several short
        steps instead of one long eager step that every running stream waits for. A backlog that outlasts
        ``backlog_steps`` such steps lifts it: under sustained prompt load, larger steps prefill more tokens
        a second (H100, Llama-3-8B: ~36,000 at 2,048 tokens a step, ~38,700 at 8,000). None: no limit.
        kv_window: the most trailing tokens any query attends to, where every layer has a sliding window (the
        model's kv_window): blocks behind it are given back as a sequence advances, so a sequence holds about
        a window of blocks, however long."""
        self.bm = block_manager
        self.kv_window = kv_window
        self.mixed_step_limit = mixed_step_limit
        self.backlog_steps = 4
        self._backlog_in_a_row = 0  # steps in a row after which prompt tokens were still waiting
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        # prefilling at every step suits eager devices; devices that replay
        # recorded decode steps decode alone most steps (replayed) and prefill
        # (with the decoding sequences along, eagerly) when ``refill_slots`` of
        # the batch are free, or at most every ``prefill_interval`` decode steps
        self.mix = mix_prefill_decode
        self.prefill_interval = prefill_interval
        # free slots that call for a prefill step: a thirty-second of the batch (H100, the 2000-request
        # benchmark at batch 256: 8 slots 13,082 output tok/s, 16 13,055, 32 13,000, 64 12,822)
        self.refill_slots = max(1, max_batch_size // 32)
        self._decode_steps = 0
        self.on_too_long = on_too_long  # finishes a sequence that can never fit
        self.waiting: Deque[Sequence] = deque()
        self.running: List[Sequence] = []
        self.idle: Dict[int, Sequence] = {}  # interactive sessions between turns
        self.num_preemptions = 0

    # ------------------------------------------------------------- queueing
    def add(self, seq: Sequence):
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def all_sequences(self) -> List[Sequence]:
        return list(self.waiting) + self.running + list(self.idle.values())

    # ------------------------------------------------------------ sessions
    def idle_session(self, session_id: int) -> Optional[Sequence]:
        """The session's sequence if it is idle between turns (it stays idle)."""
        return self.idle.get(session_id)

    def resume(self, session_id: int) -> Optional[Sequence]:
        """Take an idle session out of ``idle`` for its next turn (its blocks come along); None if there
        is none. The caller starts the turn and ``add``s it."""
        return self.idle.pop(session_id, None)

    def park(self, seq: Sequence):
        """An interactive turn ended: out of the queues, blocks kept, idle until its next turn (or until
        ``end_session``; ``_free_idle_session`` may drop its cache meanwhile)."""
        self._drop_in_flight(seq)
        self.remove(seq, keep_blocks=True)
        seq.status = SeqStatus.IDLE
        # the cache may hold fewer tokens than the history; the rest is recomputed next turn
        seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)
        self.idle[seq.session_id] = seq

    def finish(self, seq: Sequence):
        """A request ended for good: out of the queues, its blocks freed (a sequence the scheduler
        already let go, as one too long for the cache, is only marked)."""
        self._drop_in_flight(seq)
        self.remove(seq)
        seq.status = SeqStatus.FINISHED

    def end_session(self, session_id: int):
        """Forget an idle session and free its cache (a running one is ``finish``ed by the engine first)."""
        seq = self.idle.pop(session_id, None)
        if seq is not None:
            self.remove(seq)

    @staticmethod
    def _drop_in_flight(seq: Sequence):
        if seq.unresolved:  # a token still in flight is dropped with the request
            seq.token_ids.pop()
            seq.num_generated -= 1

    def remove(self, seq: Sequence, keep_blocks: bool = False):
        """Take a sequence out of every queue; free its blocks unless kept."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.idle.get(seq.session_id) is seq:
            del self.idle[seq.session_id]
        if not keep_blocks:
            self._release(seq)

    def check_invariants(self):
        """Assert that every KV block is free or owned by the sequences' block tables, counts consistent."""
        self.bm.check_invariants(s.block_ids for s in self.all_sequences())

    def reset_counters(self):
        """Zero the statistics kept here and in the block manager (preemptions, prefix-cache hits)."""
        self.num_preemptions = 0
        self.bm.num_prefix_hits = 0

    def _release(self, seq: Sequence):
        self.bm.free(seq.block_ids)
        seq.block_ids, seq.block_keys = [], []
        seq.num_computed = 0

    def _preempt(self, seq: Sequence):
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _free_idle_session(self) -> bool:
        """Drop the cache of one idle interactive session (recomputed on its next turn)."""
        for seq in self.idle.values():
            if seq.block_ids:
                self._release(seq)
                return True
        return False

    def _slide(self, seq: Sequence):
        """Give back the leading blocks no query at or after position ``num_computed`` sees (with a window W
        it sees positions above its own less W); their entries become FREED. Called before a launched step's
        tokens are counted, so the step in flight never loses a block it reads."""
        bs = self.bm.block_size
        i = min(max(0, seq.num_computed - self.kv_window + 1) // bs, len(seq.block_ids))
        gone = []
        while i > 0 and seq.block_ids[i - 1] != FREED:
            i -= 1
            gone.append(seq.block_ids[i])
            seq.block_ids[i] = FREED
        self.bm.free(reversed(gone))

    def _blocks_needed(self, seq: Sequence) -> int:
        """The most blocks the sequence holds at once: all of them, or with a sliding window the window's
        and two steps' worth (the one scheduled and the one whose tokens it waits to give back)."""
        need = self.bm.blocks_for(seq.num_tokens)
        if self.kv_window is None:
            return need
        return min(need, self.bm.blocks_for(self.kv_window + 2 * self.max_prefill_tokens) + 2)

    def _held(self, seq: Sequence) -> int:
        """Blocks the sequence owns now (entries given back behind a window are not)."""
        if self.kv_window is None:
            return len(seq.block_ids)
        return len(seq.block_ids) - seq.block_ids.count(FREED)

    def _prompt_blocks(self, seq: Sequence) -> int:
        """Blocks the sequence owns once its tokens so far are computed: all of theirs, or a window's."""
        need = self.bm.blocks_for(seq.num_tokens)
        if self.kv_window is None:
            return need
        return min(need, self.bm.blocks_for(self.kv_window) + 1)

    def _headroom(self) -> int:
        """Blocks a newly admitted prompt may still claim: the free ones (and idle sessions' caches) less what
        the running prompts need to finish, one block of decode growth for every running sequence, and with
        a window the chunks in flight beyond the windows (a step's, and the last one's, freed a step late)."""
        free = self.bm.num_free + sum(self._held(s) for s in self.idle.values())
        prefilling = [s for s in self.running if s.num_pending > 1]
        owed = sum(max(0, self._prompt_blocks(s) - self._held(s)) for s in prefilling)
        in_flight = 0
        if self.kv_window is not None:
            in_flight = 2 * self.bm.blocks_for(self.max_prefill_tokens) + len(prefilling)
        return free - owed - len(self.running) - in_flight

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the sequence own enough blocks for ``num_tokens`` tokens."""
        need = self.bm.blocks_for(num_tokens) - len(seq.block_ids)
        while need > self.bm.num_free:
            if not self._free_idle_session():
                return False
        if need > 0:
            seq.block_ids.extend(self.bm.allocate(need))
        return True

    def can_run_ahead(self) -> bool:
        """Whether the next step can be scheduled while the step in flight
        still holds unresolved tokens: nothing may need preempting (a
        preempted sequence would be re-prefilled from an unknown token)."""
        need = 0
        for seq in self.running:
            if not seq.final_token_in_flight:
                need += max(0, self.bm.blocks_for(seq.num_tokens) - len(seq.block_ids))
        return need <= self.bm.num_free

    # ------------------------------------------------------------- stepping
    def _phase(self) -> str:
        if self.mix:
            return 'prefill'
        decoding = sum(1 for s in self.running if s.num_pending == 1)
        prefilling = len(self.running) - decoding
        # refill when a good share of the batch is free, or every prefill_interval steps
        free_slots = self.max_batch_size - len(self.running)
        if prefilling or (self.waiting and (decoding == 0 or self._decode_steps >= self.prefill_interval
                                            or free_slots >= self.refill_slots)):
            return 'prefill'
        return 'decode'

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule(self._phase())
        self._decode_steps = self._decode_steps + 1 if batch.is_decode else 0
        # prompt tokens this step leaves waiting: sequences not admitted, or prompts it takes only part of
        given = {id(seq): n for seq, n in zip(batch.seqs, batch.num_new_tokens)}
        backlog = bool(self.waiting) or any(s.num_pending > 1 and s.num_pending > given.get(id(s), 0)
                                            for s in self.running)
        self._backlog_in_a_row = self._backlog_in_a_row + 1 if backlog else 0
        return batch

    def _step_limits(self, phase: str) -> Tuple[int, Optional[int]]:
        """(prompt tokens, prompt sequences) this step may take: the prefill budget, or less where the step
        carries decode rows and must stay within ``mixed_step_limit``."""
        if self.mixed_step_limit is None or phase == 'decode' or self._backlog_in_a_row >= self.backlog_steps:
            return self.max_prefill_tokens, None
        decoding = sum(1 for s in self.running if s.num_pending == 1 and not s.final_token_in_flight)
        if not decoding:
            return self.max_prefill_tokens, None
        tokens, prompts = self.mixed_step_limit
        return max(0, min(self.max_prefill_tokens, tokens - decoding)), prompts

    def _schedule(self, phase: str) -> ScheduledBatch:
        seqs, counts = [], []
        budget, prompt_slots = self._step_limits(phase)
        if prompt_slots is None:
            prompt_slots = self.max_batch_size
        # running sequences, oldest first; the youngest give way when blocks run out
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = seq.num_pending
            if seq.final_token_in_flight:
                i += 1
                continue
            if phase == 'decode' and n > 1:
                i += 1
                continue
            if n > 1:
                n = min(n, budget) if prompt_slots > 0 else 0
                if n == 0:
                    i += 1
                    continue
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                if victim is seq and i == 0:
                    # alone and still too big: the cache can never hold it
                    self.running.remove(seq)
                    self._release(seq)
                    self.on_too_long(seq, 'the KV cache cannot hold this sequence')
                    break
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                counts.append(n)
                if n > 1 or seq.num_pending > 1:
                    budget -= n
                    prompt_slots -= 1
                i += 1
                continue
            # seq left the running list; i now points at the next one
        # admit waiting sequences, each only while the cache can also finish it: a prompt admitted for its
        # first chunk alone would later take its other chunks' blocks from running sequences (preempting
        # them, recomputed later: long prompts under load did each other's work about twice on an H100)
        headroom = None
        while (phase != 'decode' and self.waiting and budget > 0 and prompt_slots > 0
               and len(self.running) < self.max_batch_size):
            seq = self.waiting[0]
            if self._blocks_needed(seq) > self.bm.num_blocks:
                self.waiting.popleft()
                self._release(seq)
                self.on_too_long(seq, f'the prompt needs {self._blocks_needed(seq)} KV blocks, '
                                 f'the cache has {self.bm.num_blocks}')
                continue
            matched = False
            if seq.num_computed == 0 and not seq.block_ids and not seq.params.needs_all_rows:
                # the last token is always recomputed: its logits are needed
                blocks, keys = self.bm.match_prefix(seq.token_ids, seq.num_tokens - 1, seq.params.share_prompt)
                seq.block_ids, seq.block_keys = blocks, keys
                seq.num_computed = len(blocks) * self.bm.block_size
                matched = bool(blocks)
            if headroom is None:
                headroom = self._headroom()
            need = max(0, self._prompt_blocks(seq) - self._held(seq))
            n = min(seq.num_pending, budget)
            if (self.running and need > headroom) or not self._grow(seq, seq.num_computed + n):
                if matched:  # a waiting sequence holds no blocks it might starve others of
                    self._release(seq)
                break
            headroom -= need + 1
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            prompt_slots -= 1
        # one-token rows first: the attention layer runs them as one decode batch
        rows = sorted(range(len(seqs)), key=lambda r: counts[r] != 1)
        return ScheduledBatch([seqs[r] for r in rows], [counts[r] for r in rows])

    def postprocess(self, batch: ScheduledBatch) -> Tuple[List[int], List[Tuple[Sequence, int]]]:
        """The step of ``batch`` is launched: count its tokens as computed and key the blocks they fill
        (prefix caching, or the prompt blocks of n samples of one prompt). Returns each sequence's first
        row in the step's output and (sequence, last row) for those ready to sample."""
        starts, done = [], []
        row = 0
        bm = self.bm
        keyed, bs = bm.prefix_caching, bm.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            starts.append(row)
            if self.kv_window is not None:
                self._slide(seq)
            seq.num_computed += n
            if keyed:  # only known tokens are keyed (a block holding a token in flight is keyed next step)
                bm.register_full_blocks(seq.token_ids, min(seq.num_computed, seq.num_resolved),
                                        seq.block_ids, seq.block_keys)
            elif seq.params.share_prompt and len(seq.block_keys) * bs < seq.num_prompt_tokens:
                # n samples of one prompt, prefix caching off: the prompt's blocks only
                bm.register_full_blocks(seq.token_ids, min(seq.num_computed, seq.num_prompt_tokens),
                                        seq.block_ids, seq.block_keys, shared=True)
            if seq.num_computed == len(seq.token_ids):
                done.append((seq, row + n - 1))
            row += n
        return starts, done
