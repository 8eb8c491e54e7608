"""benchmark/random_model.py's streamed writer (what makes the 70B shape on a machine whose GPUs cannot hold it
whole): a small shape written a tensor at a time over several shards loads in transformers, and this engine
gives transformers' greedy tokens on it (cpu, float32)."""
import json
import os
import random

import torch
from engine_utils import generate_all, greedy
from helpers import benchmark_module, hf_greedy_fresh

from lmdeploy.engine.engine import Engine
from lmdeploy.messages import PytorchEngineConfig

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=160, vocab_size=600)


def test_streamed_checkpoint_is_sharded_complete_and_runs(tmp_path):
    rm = benchmark_module('random_model')
    out = str(tmp_path / 'streamed')
    seed = random.randrange(1 << 30)
    rm.make_model_streamed('llama-small', out, dtype='float32', seed=seed, shard_bytes=96 << 10, **SMALL)
    with open(os.path.join(out, 'model.safetensors.index.json')) as f:
        index = json.load(f)
    shards = sorted(set(index['weight_map'].values()))
    assert len(shards) > 2 and shards == sorted(n for n in os.listdir(out) if n.endswith('.safetensors'))
    assert all(n.endswith(f'-of-{len(shards):05d}.safetensors') for n in shards)

    from safetensors.torch import load_file
    state = {}
    for name in shards:
        state.update(load_file(os.path.join(out, name)))
    assert sorted(state) == sorted(index['weight_map'])
    assert index['metadata']['total_size'] == sum(t.numel() * t.element_size() for t in state.values())
    # the drawing scheme: norms around 1, the residual writers scaled down by depth
    norm = state['model.norm.weight']
    assert abs(norm.mean().item() - 1.0) < 0.05 and norm.std().item() > 0.02
    down, up = state['model.layers.0.mlp.down_proj.weight'], state['model.layers.0.mlp.up_proj.weight']
    assert down.std().item() < up.std().item()

    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert sorted(hf.state_dict()) == sorted(state)  # every tensor the model has, and no other

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, SMALL['vocab_size']) for _ in range(n)] for n in (4, 19, 33)]
    want = hf_greedy_fresh(out, prompts, 8)
    engine = Engine(out, PytorchEngineConfig(device_type='cpu', dtype='float32', session_len=128,
                                             max_batch_size=4, cache_max_entry_count=0.05))
    try:
        got = generate_all(engine, prompts, greedy(8))
    finally:
        engine.close()
    assert got == want
