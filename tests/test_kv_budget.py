"""The KV cache's budget is a share of the memory left once the weights are loaded: loading's temporaries,
which an allocator keeps cached (on an H100, 15.9 GB beside Llama-3-8B's 15.0 GB of weights), are given back
to the device first, so the budget counts them (engine/rank.py, DeviceRuntime.release_cached_memory)."""
from lmdeploy.devices.cpu.runtime import CpuRuntime
from lmdeploy.engine import rank
from lmdeploy.engine.engine import Engine
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

    def sized(config, device, plan, bytes_per_block):
        calls.append('size')
        return size(config, device, plan, bytes_per_block)

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
