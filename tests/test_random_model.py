"""benchmark/random_model.py's streamed writer (what makes the 70B shape on a machine whose GPUs cannot hold it
whole): a small shape written a tensor at a time over several shards loads in transformers, and this engine
gives transformers' greedy tokens on it (cpu, float32)."""
import json
import os
import random

import torch
from engine_utils import engine_tokens
from helpers import benchmark_module, hf_greedy_fresh

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=160, vocab_size=600)
TINY_ENGINE = dict(device_type='cpu', dtype='float32', session_len=128, max_batch_size=4, cache_max_entry_count=0.05)


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
    assert engine_tokens(out, prompts, 8, **TINY_ENGINE) == want


def test_streamed_awq_checkpoint_is_the_rounded_float_one(tmp_path):
    """``--awq``: the layers' projections come out in AWQ's format, rounded from the very draws the float
    writer makes, so this engine on it gives transformers' greedy tokens on the float model with those
    weights rounded (lite.pack.fake_quantize) and nothing else changed."""
    rm = benchmark_module('random_model')
    from safetensors.torch import load_file, save_file

    from lmdeploy.lite.pack import fake_quantize
    seed, group = random.randrange(1 << 30), 32
    awq, flt = str(tmp_path / 'awq'), str(tmp_path / 'float')
    rm.make_model_streamed('llama-small', awq, dtype='float32', seed=seed, awq_group=group, **SMALL)
    rm.make_model_streamed('llama-small', flt, dtype='float32', seed=seed, **SMALL)
    with open(os.path.join(awq, 'config.json')) as f:
        assert json.load(f)['quantization_config'] == {'quant_method': 'awq', 'version': 'gemm', 'bits': 4,
                                                       'group_size': group, 'zero_point': True}
    names = set()
    for name in os.listdir(awq):
        if name.endswith('.safetensors'):
            names.update(load_file(os.path.join(awq, name)))
    assert 'model.layers.1.mlp.down_proj.qweight' in names and 'model.layers.1.mlp.down_proj.weight' not in names
    assert 'lm_head.weight' in names and 'model.embed_tokens.weight' in names

    for name in os.listdir(flt):  # the float model, its projections rounded as the AWQ writer rounded them
        if name.endswith('.safetensors'):
            path = os.path.join(flt, name)
            state = load_file(path)
            for k, v in state.items():
                if '.layers.' in k and k.endswith('_proj.weight'):
                    state[k] = fake_quantize(v, group)
            save_file(state, path, metadata={'format': 'pt'})

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, SMALL['vocab_size']) for _ in range(n)] for n in (5, 23)]
    want = hf_greedy_fresh(flt, prompts, 8)
    assert engine_tokens(awq, prompts, 8, **TINY_ENGINE) == want
