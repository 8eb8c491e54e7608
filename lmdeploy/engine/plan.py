"""What a rank agreed at start-up, in one object (rank.py builds it; the runner, its graph runners and
profiling read it whole)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from lmdeploy.devices.cache import KVCacheSpec
from lmdeploy.devices.runtime import GRAPHS_NONE, GRAPHS_STEPS, ExecutionPlan

from .model_config import ModelConfig
from .nn.parallel import head_shard, tensor_parallel


def kv_cache_spec(device, cfg: ModelConfig, block_size: int, dtype: torch.dtype, quant_policy: int = 0) -> KVCacheSpec:
    """One layer's cache of this rank's KV heads as the device lays it out (every layer's is alike)."""
    tp = tensor_parallel()
    _, kv_heads = head_shard(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.size)
    return device.kv_cache_spec(len(kv_heads), cfg.head_dim, block_size, dtype, quant_policy)


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One rank's start-up agreement: its cache, its limits and how its steps run."""
    kv_spec: KVCacheSpec  # one layer's cache on this rank (block size, quant_policy, layout)
    num_blocks: int  # KV blocks of every layer (0 until the ranks agree on it: profiling runs before)
    session_len: int
    max_batch_size: int
    max_step_tokens: int  # the largest step: one prefill chunk plus a token for each decoding sequence
    max_mixed_tokens: int  # steps with prompt rows are recorded up to this many tokens
    dtype: torch.dtype  # the model's
    graphs: str  # the device's graph mode (devices/runtime.py), GRAPHS_NONE in eager mode
    records_mixed_steps: bool  # with whole-step graphs: steps with prompt rows are recorded too
    profile_memory: bool
    memory_is_host_ram: bool
    key_mean_spec: Optional[KVCacheSpec] = None  # the unquantized cache the mean keys are measured in
    # (when kv_spec centres keys: int4)

    @classmethod
    def build(cls, device, cfg: ModelConfig, execution: ExecutionPlan, *, dtype: torch.dtype, block_size: int,
              quant_policy: int, session_len: int, max_batch_size: int, max_step_tokens: int, max_mixed_tokens: int,
              eager: bool, num_blocks: int = 0) -> 'RankPlan':
        """The device lays out the cache (and refuses a quantization it lacks, here at start-up)."""
        spec = kv_cache_spec(device, cfg, block_size, dtype, quant_policy)
        means = kv_cache_spec(device, cfg, block_size, dtype, 0) if spec.centres_keys else None
        return cls(spec, num_blocks, session_len, max_batch_size, max_step_tokens, max_mixed_tokens, dtype,
                   GRAPHS_NONE if eager else execution.graphs, execution.records_mixed_steps,
                   execution.profile_memory, execution.memory_is_host_ram, means)

    @property
    def block_size(self) -> int:
        return self.kv_spec.block_size

    @property
    def quant_policy(self) -> int:
        return self.kv_spec.quant_policy

    @property
    def max_blocks(self) -> int:
        """Block table columns of the longest session."""
        return -(-self.session_len // self.block_size)

    @property
    def replays_steps(self) -> bool:
        """Whole steps are recorded and replayed (graph_runner.py): prompts are then prefilled apart from
        decode steps most of the time (the scheduler's mix_prefill_decode off), and requests are warmed up."""
        return self.graphs == GRAPHS_STEPS

    @property
    def mix_prefill_decode(self) -> bool:
        """Eager steps (or steps in pieces) cost the host alike whatever rows they carry: prefill every step."""
        return not self.replays_steps
