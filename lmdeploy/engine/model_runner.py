"""Packs a scheduled batch into tensors, runs the model, owns the KV cache."""
from __future__ import annotations

from typing import List, Tuple

import torch

from lmdeploy.devices.interface import DeviceOps

from .graph_runner import GraphRunner
from .model_config import ModelConfig
from .nn import StepContext
from .scheduler import ScheduledBatch


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, device: DeviceOps, dtype: torch.dtype,
                 num_blocks: int, block_size: int, max_batch_size: int, eager: bool, session_len: int):
        self.model = model
        self.cfg = cfg
        self.device = device
        self.torch_device = device.torch_device()
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches: List[Tuple[torch.Tensor, torch.Tensor]] = [
            (torch.empty(shape, dtype=dtype, device=self.torch_device),
             torch.empty(shape, dtype=dtype, device=self.torch_device)) for _ in range(cfg.num_layers)
        ]
        self._forward = self._eager_forward
        if device.supports_graphs and not eager:
            self._forward = GraphRunner(device, self._eager_forward, self.kv_caches, max_batch_size,
                                        -(-session_len // block_size), session_len, self.torch_device)
        self._pin = self.torch_device.type != 'cpu'

    def _eager_forward(self, input_ids, positions, ctx: StepContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def build_inputs(self, batch: ScheduledBatch):
        ids: List[int] = []
        positions: List[int] = []
        slots: List[int] = []
        rope_lens: List[int] = []
        q_lens, kv_lens = [], []
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed
            ids.extend(seq.token_ids[start:start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            table = seq.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            rope_lens.extend([seq.num_tokens] * n)
            q_lens.append(n)
            kv_lens.append(start + n)
        width = max(len(s.block_ids) for s in batch.seqs)
        tables = torch.zeros((len(batch.seqs), width), dtype=torch.int32)
        for i, seq in enumerate(batch.seqs):
            tables[i, :len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        q_start = torch.zeros_like(q_lens_t)
        q_start[1:] = q_lens_t.cumsum(0)[:-1]
        dev = self.torch_device

        def to(t):
            if not self._pin:
                return t
            return t.pin_memory().to(dev, non_blocking=True)

        ctx = StepContext(is_decode=batch.is_decode, q_start_loc=to(q_start), q_seqlens=to(q_lens_t),
                          kv_seqlens=to(torch.tensor(kv_lens, dtype=torch.int64)), block_tables=to(tables),
                          slot_mapping=to(torch.tensor(slots, dtype=torch.int64)),
                          rope_lens=to(torch.tensor(rope_lens, dtype=torch.int64)), max_q_len=max(q_lens),
                          max_kv_len=max(kv_lens), kv_caches=self.kv_caches)
        return (to(torch.tensor(ids, dtype=torch.int64)), to(torch.tensor(positions, dtype=torch.int64)), ctx)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of every token of the batch."""
        input_ids, positions, ctx = self.build_inputs(batch)
        return self._forward(input_ids, positions, ctx)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


@torch.inference_mode()
def profile_peak_memory(model: torch.nn.Module, cfg: ModelConfig, device: DeviceOps, dtype: torch.dtype,
                        num_tokens: int, block_size: int, max_batch_size: int):
    """Run the largest step the engine will run (one prefill of
    ``num_tokens`` plus logits for a full batch) so that the allocator has
    reserved its activation memory before the KV cache takes the rest."""
    dev = device.torch_device()
    num_blocks = -(-num_tokens // block_size)
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.empty(shape, dtype=dtype, device=dev), torch.empty(shape, dtype=dtype, device=dev))
              for _ in range(cfg.num_layers)]
    positions = torch.arange(num_tokens, device=dev)
    ids = torch.randint(0, cfg.vocab_size, (num_tokens, ), device=dev)
    ctx = StepContext(is_decode=False, q_start_loc=torch.zeros(1, dtype=torch.int64, device=dev),
                      q_seqlens=torch.tensor([num_tokens], device=dev), kv_seqlens=torch.tensor([num_tokens],
                                                                                                device=dev),
                      block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None], slot_mapping=positions,
                      rope_lens=torch.full((num_tokens, ), num_tokens, device=dev), max_q_len=num_tokens,
                      max_kv_len=num_tokens, kv_caches=caches)
    hidden = model(ids, positions, ctx)
    model.compute_logits(hidden[-1:].expand(max_batch_size, -1))
    device.synchronize()
    del caches, hidden
