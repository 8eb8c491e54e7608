"""Packs a scheduled batch into tensors, runs the model, owns the KV cache."""
from __future__ import annotations

import contextlib
import gc
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from lmdeploy.devices.cache import KEY_MEAN_TOKENS, KVCache, KVCacheSpec
from lmdeploy.devices.interface import DeviceOps
from lmdeploy.devices.runtime import GRAPHS_PIECES, GRAPHS_STEPS

from .graph_runner import GraphRunner
from .model_config import ModelConfig
from .nn import StepContext
from .piecewise import PiecewiseRunner
from .plan import RankPlan
from .scheduler import ScheduledBatch
from .transfer import int64_tensor, tensor_on, to_device


class StepMeta(NamedTuple):
    """The sizes that go with a step's packed inputs."""
    is_decode: int
    num_tokens: int
    n_prev: int  # tokens that are placeholders for the step in flight
    bsz: int
    width: int  # block table columns
    num_decode: int
    max_q_len: int
    max_kv_len: int


class ModelRunner:

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, device: DeviceOps, plan: RankPlan):
        """``plan``: what this rank agreed at start-up (its cache, limits, graph mode: plan.py)."""
        self.model = model
        self.cfg = cfg
        self.device = device
        self.runtime = device.runtime
        self.plan = plan
        self.torch_device = self.runtime.torch_device()
        self.block_size = plan.block_size
        spec = plan.kv_spec
        # measured before the cache takes its memory (a prompt's activations and a small cache of its own)
        means = mean_keys(model, cfg, device, plan.key_mean_spec,
                          min(KEY_MEAN_TOKENS, plan.session_len)) if spec.centres_keys else None
        self.kv_caches: List[KVCache] = [spec.allocate(plan.num_blocks, self.torch_device)
                                         for _ in range(cfg.num_layers)]
        for cache, mean in zip(self.kv_caches, means or ()):  # before anything is written or recorded
            cache.set_key_mean(mean)
        # recorded steps where the plan says: whole decode and mixed steps (graph_runner.py), or mixed steps in
        # pieces with attention live between them (piecewise.py) on devices that record only those
        self.graphs: Optional[GraphRunner] = None
        self.pieces: Optional[PiecewiseRunner] = None
        with torch.inference_mode(), _recording_memory_hint(plan):
            if plan.graphs == GRAPHS_STEPS:
                self.graphs = GraphRunner(self.runtime, self._eager_forward, self.kv_caches, plan)
                self.graphs.capture_all()
            elif plan.graphs == GRAPHS_PIECES and plan.max_mixed_tokens > 0:
                self.pieces = PiecewiseRunner(self.runtime, model, self.kv_caches, plan)
                self.pieces.capture_all()

    def recorded_step_limit(self) -> Optional[Tuple[int, int]]:
        """(tokens, prompt sequences) of the largest step with prompt rows that replays a recording, or None
        where none is recorded: the scheduler keeps steps that carry decode rows within it, so a burst of
        prompts never turns a running batch's step into a long eager one."""
        if self.graphs is not None and self.graphs.mixed_sizes:
            return self.graphs.mixed_limit()
        if self.pieces is not None:
            return self.pieces.sizes[-1], None
        return None

    def drop_recordings(self):
        """Forget the recorded steps once no step will run: under tensor parallelism they hold the collectives
        of a process group about to be destroyed, and go before it, not in the interpreter's teardown."""
        self.graphs = self.pieces = None
        gc.collect()

    def _eager_forward(self, input_ids, positions, ctx: StepContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def pack_inputs(self, batch: ScheduledBatch, with_prev: bool) -> Tuple[List[int], StepMeta]:
        """A step's inputs as one host list of integers and a few sizes (which
        :meth:`unpack_inputs` turns into tensors after one host-to-device copy).
        A decode step's metadata is all computed on the host (a small batch
        would otherwise spend more time in tiny derivation kernels than in its
        copy); a prefill step's per-token positions and slots are derived on
        the device. ``with_prev``: placeholder tokens ``-1 - row`` stand for
        the sampled tokens of the step still in flight."""
        seqs, counts = batch.seqs, batch.num_new_tokens
        bsz, bs = len(seqs), self.block_size
        if batch.is_decode:
            tokens = [seq.token_ids[seq.num_computed] for seq in seqs]
        else:
            tokens: List[int] = []
            for seq, n in zip(seqs, counts):
                start = seq.num_computed
                tokens.extend(seq.token_ids[start:start + n])
        num_tokens = len(tokens)
        flat, n_prev = list(tokens), 0
        if with_prev:
            src = [-1 - t if t < 0 else -1 for t in tokens]  # row in prev_tokens, or -1
            n_prev = num_tokens - src.count(-1)
            if n_prev:
                flat = [t if t >= 0 else 0 for t in tokens] + src
        starts = [seq.num_computed for seq in seqs]
        if batch.is_decode:
            flat += starts  # positions
            flat += [p + 1 for p in starts]  # kv lengths
            flat += [seq.block_ids[p // bs] * bs + p % bs for seq, p in zip(seqs, starts)]  # slots
            flat += [1] * bsz  # q lengths
            flat += range(bsz)  # q starts
        else:
            flat += counts
            flat += starts
        # the one-token rows lead the batch (the scheduler puts them first)
        num_decode = bsz if batch.is_decode else next((r for r, n in enumerate(counts) if n != 1), bsz)
        flat += sorted(range(num_decode), key=lambda i: -starts[i])  # those rows, longest context first
        flat += [seq.num_tokens for seq in seqs]  # rotary length (dynamic NTK)
        width = max(len(seq.block_ids) for seq in seqs)
        for seq in seqs:
            flat += seq.block_ids
            flat += [0] * (width - len(seq.block_ids))
        meta = StepMeta(int(batch.is_decode), num_tokens, n_prev, bsz, width, num_decode, max(counts),
                        max(c + n for c, n in zip(starts, counts)))
        return flat, meta

    def unpack_inputs(self, dev: torch.Tensor, meta: StepMeta, prev_tokens: Optional[torch.Tensor] = None):
        """(input ids, positions, StepContext) from the packed inputs on the device. A placeholder token is
        taken from ``prev_tokens[row]`` on the device; without ``prev_tokens`` it is left as 0 (a rank
        other than the first gets the resolved ids from it)."""
        is_decode, num_tokens, n_prev, bsz, width, num_decode, max_q_len, max_kv_len = meta
        bs = self.block_size
        fields = [num_tokens] * (2 if n_prev else 1)
        fields += [bsz] * (5 if is_decode else 2) + [num_decode, bsz, bsz * width]
        parts = list(dev.split(fields))
        ids = parts.pop(0)
        if n_prev:
            rows = parts.pop(0)
            if prev_tokens is None:
                pass
            elif n_prev == num_tokens:
                ids = prev_tokens.index_select(0, rows)
            else:
                ids = torch.where(rows >= 0, prev_tokens.index_select(0, rows.clamp(min=0)), ids)
        tables = parts.pop().view(bsz, width)
        if is_decode:
            positions, kv_lens, slots, q_lens, q_start, order, rope_lens = parts
        else:
            q_lens, computed, order, rope = parts
            q_start = q_lens.cumsum(0) - q_lens
            seq_idx = torch.repeat_interleave(torch.arange(bsz, device=dev.device), q_lens, output_size=num_tokens)
            positions = computed[seq_idx] + torch.arange(num_tokens, device=dev.device) - q_start[seq_idx]
            slots = tables[seq_idx, positions // bs] * bs + positions % bs
            kv_lens = computed + q_lens
            rope_lens = rope[seq_idx]
        ctx = StepContext(is_decode=bool(is_decode), q_start_loc=q_start, q_seqlens=q_lens, kv_seqlens=kv_lens,
                          block_tables=tables.to(torch.int32), slot_mapping=slots,
                          rope_lens=rope_lens, max_q_len=max_q_len, max_kv_len=max_kv_len, kv_caches=self.kv_caches,
                          num_decode=0 if is_decode else num_decode, decode_order=order)
        return ids, positions, ctx

    def build_inputs(self, batch: ScheduledBatch, prev_tokens: Optional[torch.Tensor] = None):
        flat, meta = self.pack_inputs(batch, prev_tokens is not None)
        return self.unpack_inputs(to_device(int64_tensor(flat), self.torch_device), meta, prev_tokens)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, prev_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states [T, hidden] of every token of the batch."""
        return self.run(*self.build_inputs(batch, prev_tokens))

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The step as recorded (whole, or in pieces) where it fits, else eagerly."""
        if self.graphs is not None and self.graphs.fits(input_ids, ctx):
            return self.graphs(input_ids, positions, ctx)
        if not ctx.is_decode and self.pieces is not None and self.pieces.fits(input_ids.shape[0]):
            return self.pieces(input_ids, positions, ctx)
        return self._eager_forward(input_ids, positions, ctx)

    def rows(self, hidden: torch.Tensor, rows: List[int]) -> torch.Tensor:
        """hidden[rows], without making the host wait for the device (an index
        list copied from pageable memory would wait for the queued step)."""
        if rows == list(range(hidden.shape[0])):
            return hidden
        return hidden[tensor_on(rows, self.torch_device, torch.int64)]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Logits of ``hidden``, which holds rows ``rows`` of the step's hidden states (all when None): the
        tensor-parallel runner has the other ranks compute the same rows)."""
        return self.model.compute_logits(hidden)

    def greedy(self, hidden: torch.Tensor, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """argmax of the logits of ``hidden`` (rows ``rows`` of the step's hidden states, as :meth:`logits`):
        int64 [T], on the device."""
        return self.model.greedy(hidden)


@contextlib.contextmanager
def _recording_memory_hint(plan: RankPlan):
    """Running out of device memory while recording the steps says what to change."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise RuntimeError(
            f'recording the engine\'s steps (decode steps up to {plan.max_batch_size} sequences, steps with '
            f'prompt rows up to {plan.max_mixed_tokens} tokens) ran out of device memory once the KV cache had '
            f'its {plan.num_blocks} blocks: lower cache_max_entry_count or max_prefill_token_num, or set '
            f'eager_mode=True ({e})') from e


@torch.inference_mode()
def profile_peak_memory(model: torch.nn.Module, cfg: ModelConfig, device: DeviceOps, plan: RankPlan):
    """Run the largest step the engine will run (one prefill of ``plan.max_step_tokens`` plus logits for a
    full batch) so that the allocator has reserved its activation memory before the KV cache takes the rest.
    Returns that step's activation bytes at their peak (0 where the device keeps no count)."""
    num_tokens, spec, runtime = plan.max_step_tokens, plan.kv_spec, device.runtime
    dev = runtime.torch_device()
    caches = [spec.allocate(-(-num_tokens // spec.block_size), dev) for _ in range(cfg.num_layers)]
    for cache in caches if spec.centres_keys else ():  # the fill kernels the engine will run compile here
        cache.set_key_mean(torch.zeros(spec.num_kv_heads, spec.head_dim))
    runtime.start_peak_count()
    hidden = _run_one_prompt(model, torch.arange(num_tokens, device=dev) % cfg.vocab_size, caches)
    logits = model.compute_logits(hidden[-1:].expand(plan.max_batch_size, -1))
    device.argmax(logits)  # greedy picks read the model-dtype logits: compiled now, not at the first request
    model.greedy(hidden[-1:].expand(plan.max_batch_size, -1))  # (under tp: on each rank's rows)
    logits.float()
    runtime.synchronize()
    peak = runtime.peak_bytes_since_start()
    del caches, hidden
    return peak


def _run_one_prompt(model: torch.nn.Module, ids: torch.Tensor, caches: List[KVCache]) -> torch.Tensor:
    """The model over one prompt ``ids`` whose K/V go to slots 0 to len - 1 of ``caches``."""
    num_tokens, dev = ids.shape[0], ids.device
    positions = torch.arange(num_tokens, device=dev)
    lens = torch.tensor([num_tokens], device=dev)
    table = torch.arange(-(-num_tokens // caches[0].block_size), dtype=torch.int32, device=dev)[None]
    ctx = StepContext(is_decode=False, q_start_loc=torch.zeros(1, dtype=torch.int64, device=dev), q_seqlens=lens,
                      kv_seqlens=lens.clone(), block_tables=table, slot_mapping=positions,
                      rope_lens=torch.full((num_tokens, ), num_tokens, device=dev), max_q_len=num_tokens,
                      max_kv_len=num_tokens, kv_caches=caches)
    return model(ids, positions, ctx)


@torch.inference_mode()
def mean_keys(model: torch.nn.Module, cfg: ModelConfig, device: DeviceOps, spec: KVCacheSpec,
              num_tokens: int) -> List[torch.Tensor]:
    """Each layer's mean key [Hkv, D] (after RoPE, float32) over ``num_tokens`` random tokens (the same on
    every rank, whatever the machine: a seeded generator), read back from an unquantized cache of ``spec``
    (the plan's key_mean_spec): what an int4 cache takes off K (devices/cache.py). Random tokens rather than
    any text: the mean is the part of K that every token shares, and it came out as good as the evaluation
    text's own (SmolLM2-135M, int4: benchmark/RESULTS.md)."""
    dev = device.torch_device()
    ids = torch.randint(0, cfg.vocab_size, (num_tokens, ), generator=torch.Generator().manual_seed(0)).to(dev)
    caches = [spec.allocate(-(-num_tokens // spec.block_size), dev) for _ in range(cfg.num_layers)]
    _run_one_prompt(model, ids, caches)
    return [device.mean_key(cache, num_tokens) for cache in caches]
