"""The KV cache's budget is a share of the memory left once the weights are loaded: loading's temporaries,
which an allocator keeps cached (on an H100, 15.9 GB beside Llama-3-8B's 15.0 GB of weights), are given back
to the device first, so the budget counts them (engine/rank.py, DeviceRuntime.release_cached_memory). What the
recorded steps will hold in their own pool (the largest recorded step's activations) comes off first; weights
are allocated in their own dtype, never first in the build's float32."""
import pytest
import torch

from lmdeploy.devices import get_device
from lmdeploy.devices.runtime import GRAPHS_NONE, GRAPHS_STEPS, ExecutionPlan
from lmdeploy.devices.cpu.runtime import CpuRuntime
from lmdeploy.engine import rank
from lmdeploy.engine.engine import Engine
from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.model_runner import _recording_memory_hint
from lmdeploy.engine.plan import RankPlan
from lmdeploy.messages import PytorchEngineConfig


def test_cached_memory_is_released_after_loading_and_before_the_budget(tiny_model_factory, monkeypatch):
    calls = []
    load, size = rank.load_model, rank.num_blocks_for
    free = [3 << 30]  # what the device reports free: 3 GiB, and 1 GiB more once the cache is given back

    def loaded(*a, **k):
        calls.append('load')
        return load(*a, **k)

    def released(self):
        calls.append('release')
        free[0] += 1 << 30

    def sized(config, device, plan, bytes_per_block, reserve=0):
        calls.append('size')
        return size(config, device, plan, bytes_per_block, reserve=reserve)

    monkeypatch.setattr(rank, 'load_model', loaded)
    monkeypatch.setattr(rank, 'num_blocks_for', sized)
    monkeypatch.setattr(CpuRuntime, 'release_cached_memory', released)
    monkeypatch.setattr(CpuRuntime, 'memory_available', lambda self: free[0])
    config = PytorchEngineConfig(device_type='cpu', session_len=128, cache_max_entry_count=0.5,
                                 cpu_kv_cache_cap_gb=64)
    engine = Engine(tiny_model_factory('llama'), config)
    try:
        assert calls == ['load', 'release', 'size'], calls
        # half of the 4 GiB free once released (3 GiB before), in blocks of every layer's K and V
        bytes_per_block = engine.plan.kv_spec.bytes_per_block * engine.model_config.num_layers
        assert engine.stats().num_blocks == int(0.5 * (4 << 30) // bytes_per_block)
    finally:
        engine.close()


def _plan(model_dir, graphs=GRAPHS_STEPS, records_mixed_steps=True, num_blocks=0):
    execution = ExecutionPlan(graphs=graphs, records_mixed_steps=records_mixed_steps, profile_memory=True)
    return RankPlan.build(get_device('cpu'), load_model_config(model_dir), execution, dtype=torch.float32,
                          block_size=16, quant_policy=0, session_len=4096, max_batch_size=256,
                          max_step_tokens=8448, max_mixed_tokens=8192, eager=False, num_blocks=num_blocks)


def test_recorded_steps_keep_their_activations_out_of_the_kv_budget(tiny_model_factory):
    path = tiny_model_factory('llama')
    activations = 8448 * 1000 + 123  # the largest (8,448-token) step's, as the start-up profile measured them
    # mixed steps recorded up to 8,192 tokens: their share of the largest step's activations
    assert rank.recording_reserve(_plan(path), activations) == int(activations * 8192 / 8448)
    # decode steps only: a full batch's
    assert rank.recording_reserve(_plan(path, records_mixed_steps=False), activations) == int(
        activations * 256 / 8448)
    assert rank.recording_reserve(_plan(path, graphs=GRAPHS_NONE), activations) == 0  # eager: nothing recorded
    assert rank.recording_reserve(_plan(path), 0) == 0  # a device that keeps no count


def test_the_budget_is_a_share_of_the_free_memory_less_the_reserve(tiny_model_factory, monkeypatch):
    path = tiny_model_factory('llama')
    free, reserve, per_block = 10 << 30, 3 << 30, 1 << 20
    monkeypatch.setattr(CpuRuntime, 'memory_available', lambda self: free)
    config = PytorchEngineConfig(device_type='cpu', cache_max_entry_count=0.8, cpu_kv_cache_cap_gb=64)
    device, plan = get_device('cpu'), _plan(path)
    assert rank.num_blocks_for(config, device, plan, per_block) == int(0.8 * free) // per_block
    assert rank.num_blocks_for(config, device, plan, per_block, reserve=reserve) == int(
        0.8 * (free - reserve)) // per_block
    with pytest.raises(RuntimeError, match='not enough free memory'):
        rank.num_blocks_for(config, device, plan, per_block, reserve=2 * free)


def test_the_profile_reports_the_runtime_peak_count(tiny_model_factory, monkeypatch):
    """profile_peak_memory starts the device's count after its own small cache is allocated and returns what
    the count reached (the CPU keeps none: 0)."""
    from lmdeploy.engine.model_runner import profile_peak_memory
    from lmdeploy.engine.weights import load_model
    path = tiny_model_factory('llama')
    cfg, device = load_model_config(path), get_device('cpu')
    plan = _plan(path)
    plan = type(plan)(**{**plan.__dict__, 'max_step_tokens': 64, 'max_batch_size': 4})
    model = load_model(path, cfg, torch.float32, device)
    assert profile_peak_memory(model, cfg, device, plan) == 0
    events = []
    monkeypatch.setattr(CpuRuntime, 'start_peak_count', lambda self: events.append('start'))
    monkeypatch.setattr(CpuRuntime, 'peak_bytes_since_start', lambda self: events.append('read') or 4321)
    assert profile_peak_memory(model, cfg, device, plan) == 4321
    assert events == ['start', 'read']


def test_running_out_of_memory_while_recording_says_what_to_change(tiny_model_factory):
    plan = _plan(tiny_model_factory('llama'), num_blocks=1234)
    with pytest.raises(RuntimeError, match='lower cache_max_entry_count') as err:
        with _recording_memory_hint(plan):
            raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 80.00 MiB')
    assert '1234 blocks' in str(err.value) and '8192 tokens' in str(err.value)
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)


def test_weights_are_allocated_in_their_dtype(tiny_model_factory, monkeypatch):
    """load_model sets each parameter's dtype while it is on the meta device: a shard allocated first in the
    build's float32 takes twice its size at once (a Llama-3-70B rank at tp=4 had 12 GiB free after loading
    that way, 43 GiB once not)."""
    from lmdeploy.engine.weights import load_model
    seen = []
    to_empty = torch.nn.Module.to_empty

    def watched(self, *a, **k):
        seen.extend((n, p.dtype, p.device.type) for n, p in self.named_parameters())
        return to_empty(self, *a, **k)

    monkeypatch.setattr(torch.nn.Module, 'to_empty', watched)
    path = tiny_model_factory('llama')
    model = load_model(path, load_model_config(path), torch.bfloat16, get_device('cpu'))
    assert seen and all(dtype == torch.bfloat16 and where == 'meta' for _, dtype, where in seen), seen[:4]
    assert all(p.dtype == torch.bfloat16 and p.device.type == 'cpu' for p in model.parameters())
