"""What every rank builds alike: its shard of the model, its KV cache, its runner.

With tensor parallelism (tp > 1) the engine's process is rank 0 and each
other rank runs this same build in a worker process (parallel/worker.py), so
the collectives that loading, profiling and graph recording issue happen in
the same order on every rank. The ranks agree on one number of KV blocks (the
fewest any of them has room for)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from lmdeploy.messages import PytorchEngineConfig

from .model_config import DTYPES, ModelConfig
from .model_runner import ModelRunner, kv_cache_spec, profile_peak_memory
from .nn.parallel import tensor_parallel
from .weights import load_model

logger = logging.getLogger('lmdeploy')

MAX_MIXED_TOKENS = 2048


def pick_dtype(config: PytorchEngineConfig, model_config: ModelConfig, device) -> torch.dtype:
    name = config.dtype
    dtype = device.default_dtype(model_config.dtype) if name == 'auto' else DTYPES[name]
    if not device.supports_dtype(dtype):
        raise ValueError(f'dtype {dtype} is not supported on device {device.name!r}')
    return dtype


def session_len_of(config: PytorchEngineConfig, model_config: ModelConfig) -> int:
    session_len = config.session_len or model_config.max_position_embeddings
    window = model_config.sliding_window
    if window and window < session_len:
        logger.warning(f'sliding-window attention is not implemented: session_len capped at the window '
                       f'({window})')
        session_len = window
    return session_len


@dataclass
class Rank:
    model: torch.nn.Module
    dtype: torch.dtype
    session_len: int
    max_batch_size: int
    kv_spec: Any  # one layer's KVCacheSpec on this rank
    num_blocks: int
    runner: ModelRunner

    @property
    def bytes_per_block(self) -> int:
        """A block of every layer's cache (this rank's heads)."""
        return self.kv_spec.bytes_per_block * len(self.runner.kv_caches)


def _agree_on_min(value: int, device) -> int:
    """The smallest ``value`` of all ranks (every rank calls this)."""
    if tensor_parallel().size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device.torch_device())
    return int(device.all_gather(t).min())


def num_blocks_for(config: PytorchEngineConfig, device, bytes_per_block: int) -> int:
    if config.num_gpu_blocks > 0:
        return config.num_gpu_blocks
    budget = device.memory_available() * config.cache_max_entry_count
    if device.memory_is_host_ram:
        budget = min(budget, config.cpu_kv_cache_cap_gb * (1 << 30))
    num = _agree_on_min(int(budget // bytes_per_block), device)
    if num < 1:
        raise RuntimeError('not enough free memory for a single KV block; lower block_size or free memory')
    return num


def build_rank(model_path: str, config: PytorchEngineConfig, model_config: ModelConfig, device) -> Rank:
    dtype = pick_dtype(config, model_config, device)
    model = load_model(model_path, model_config, dtype, device)
    session_len = session_len_of(config, model_config)
    max_batch_size = config.max_batch_size or device.default_max_batch_size
    # the device lays out the cache (and refuses a quantization it lacks, here at start-up)
    kv_spec = kv_cache_spec(device, model_config, config.block_size, dtype, config.quant_policy)
    if device.profile_memory:
        # a prefill step also carries a token for each decoding sequence
        profile_peak_memory(model, model_config, device, dtype,
                            min(config.max_prefill_token_num, session_len) + max_batch_size,
                            config.block_size, max_batch_size, config.quant_policy)
    num_blocks = num_blocks_for(config, device, kv_spec.bytes_per_block * model_config.num_layers)
    # steps with prompt rows are recorded up to this many tokens (larger ones are long prefills, where the
    # device's work dwarfs the host's)
    max_mixed_tokens = min(MAX_MIXED_TOKENS, config.max_prefill_token_num + max_batch_size)
    runner = ModelRunner(model, model_config, device, dtype, num_blocks, config.block_size, max_batch_size,
                         config.eager_mode, session_len, max_mixed_tokens, config.quant_policy)
    return Rank(model, dtype, session_len, max_batch_size, kv_spec, num_blocks, runner)
