"""What every rank builds alike: its shard of the model, its KV cache, its runner.

With tensor parallelism (tp > 1) the engine's process is rank 0 and each
other rank runs this same build in a worker process (parallel/worker.py), so
the collectives that loading, profiling and graph recording issue happen in
the same order on every rank. The ranks agree on one number of KV blocks (the
fewest any of them has room for)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
from dataclasses import dataclass

import torch

from lmdeploy.devices.runtime import GRAPHS_NONE
from lmdeploy.messages import PytorchEngineConfig

from .model_config import DTYPES, ModelConfig
from .model_runner import ModelRunner, profile_peak_memory
from .nn.parallel import tensor_parallel
from .plan import RankPlan
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
    return config.session_len or model_config.max_position_embeddings


@dataclass
class Rank:
    model: torch.nn.Module
    plan: RankPlan  # what this rank agreed at start-up
    runner: ModelRunner

    @property
    def bytes_per_block(self) -> int:
        """A block of every layer's cache (this rank's heads)."""
        return self.plan.kv_spec.bytes_per_block * len(self.runner.kv_caches)


def _agree_on_min(value: int, device) -> int:
    """The smallest ``value`` of all ranks (every rank calls this)."""
    if tensor_parallel().size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device.runtime.torch_device())
    return int(device.all_gather(t).min())


def _package_dir() -> str:
    import lmdeploy
    return os.path.dirname(os.path.abspath(lmdeploy.__file__))


def _int64_digest(*chunks: bytes) -> int:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return int.from_bytes(h.digest()[:8], 'little', signed=True)


@functools.lru_cache(maxsize=1)
def source_digest() -> int:
    """A digest of this lmdeploy's Python source (every module's path and bytes), as an int64."""
    from lmdeploy import __version__

    def chunks():
        yield __version__.encode()
        root = _package_dir()
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != '__pycache__')
            for name in sorted(f for f in files if f.endswith('.py')):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, root).encode()
                with open(path, 'rb') as f:
                    yield f.read()
    return _int64_digest(*chunks())


def check_ranks_agree(plan: RankPlan, device):
    """Every rank runs the same lmdeploy source and the same step plan, or none starts: ranks whose steps
    differ (another copy of lmdeploy on a node, another config) would wait on each other's collectives for
    ever instead of failing. Every rank calls this; every rank raises alike."""
    if tensor_parallel().size == 1:
        return
    shape = (plan.session_len, plan.max_batch_size, plan.max_step_tokens, plan.max_mixed_tokens, str(plan.dtype),
             plan.graphs, plan.records_mixed_steps, plan.block_size, plan.kv_spec.quant_policy)
    t = torch.tensor([source_digest(), _int64_digest(repr(shape).encode())], dtype=torch.int64,
                     device=device.runtime.torch_device())
    got = device.all_gather(t).reshape(-1, 2).tolist()
    from lmdeploy import __version__
    for what, i in (('lmdeploy source', 0), ('step plan (session length, batch, step and recording sizes, '
                                              'dtype, graphs, block size, KV quantization)', 1)):
        ranks = [r for r, row in enumerate(got) if row[i] != got[0][i]]
        if ranks:
            raise RuntimeError(f'tensor-parallel ranks {ranks} have another {what} than rank 0; every rank must '
                               f'run the same lmdeploy with the same config (rank {tensor_parallel().rank} '
                               f'imports lmdeploy {__version__} from {_package_dir()})')


def recording_reserve(plan: RankPlan, activations: int) -> int:
    """Device memory the recorded steps will hold beside the KV cache: the activations of the largest
    recorded step, scaled from ``activations`` (those of the largest step, ``plan.max_step_tokens``, measured
    at start-up). A recording's pool cannot use the blocks the allocator keeps for eager steps, so without
    this a Llama-3-70B rank at tp=4 (mixed steps recorded up to 8,192 tokens) had the KV cache take the
    memory its first recording needed."""
    if plan.graphs == GRAPHS_NONE or activations <= 0:
        return 0
    tokens = plan.max_mixed_tokens if plan.records_mixed_steps else plan.max_batch_size
    return int(activations * min(1.0, tokens / max(1, plan.max_step_tokens)))


def num_blocks_for(config: PytorchEngineConfig, device, plan: RankPlan, bytes_per_block: int,
                   reserve: int = 0) -> int:
    """KV blocks of ``bytes_per_block``: ``cache_max_entry_count`` of the memory free now, less ``reserve``
    (what the recorded steps will take), agreed by every rank."""
    if config.num_gpu_blocks > 0:
        return config.num_gpu_blocks
    budget = max(0, device.runtime.memory_available() - reserve) * config.cache_max_entry_count
    if plan.memory_is_host_ram:
        budget = min(budget, config.cpu_kv_cache_cap_gb * (1 << 30))
    num = _agree_on_min(int(budget // bytes_per_block), device)
    if num < 1:
        raise RuntimeError('not enough free memory for a single KV block; lower block_size or free memory')
    return num


def plan_rank(config: PytorchEngineConfig, model_config: ModelConfig, device, dtype: torch.dtype) -> RankPlan:
    """The rank's plan before its number of KV blocks is known: the device's plan (its runtime's, read once
    here) with the engine's config. The device lays out the cache (and refuses a quantization it lacks, here
    at start-up)."""
    execution = device.runtime.plan
    session_len = session_len_of(config, model_config)
    max_batch_size = config.max_batch_size or execution.default_max_batch_size
    return RankPlan.build(
        device, model_config, execution, dtype=dtype, block_size=config.block_size, quant_policy=config.quant_policy,
        session_len=session_len, max_batch_size=max_batch_size,
        # a prefill step also carries a token for each decoding sequence
        max_step_tokens=min(config.max_prefill_token_num, session_len) + max_batch_size,
        # steps with prompt rows are recorded up to this many tokens (larger ones are long prefills, where the
        # device's work dwarfs the host's). A rank's work a token shrinks with the ranks, its host's does not,
        # so under tensor parallelism the bound grows with the ranks
        max_mixed_tokens=min(MAX_MIXED_TOKENS * tensor_parallel().size,
                             config.max_prefill_token_num + max_batch_size),
        eager=config.eager_mode)


def build_rank(model_path: str, config: PytorchEngineConfig, model_config: ModelConfig, device) -> Rank:
    dtype = pick_dtype(config, model_config, device)
    plan = plan_rank(config, model_config, device, dtype)
    check_ranks_agree(plan, device)  # before minutes of loading
    model = load_model(model_path, model_config, dtype, device)
    # loading's temporaries (a tensor's copy on its way to the device, fused projections' parts) stay in the
    # allocator's cache, where the KV budget below would not see them: on an H100, 15.9 GB for Llama-3-8B's
    # 15.0 GB of weights, which cost the cache 0.8 x 15.9 GB
    device.runtime.release_cached_memory()
    activations = profile_peak_memory(model, model_config, device, plan) if plan.profile_memory else 0
    num_blocks = num_blocks_for(config, device, plan, plan.kv_spec.bytes_per_block * model_config.num_layers,
                                reserve=recording_reserve(plan, activations))
    plan = dataclasses.replace(plan, num_blocks=num_blocks)
    return Rank(model, plan, ModelRunner(model, model_config, device, plan))
