"""Layer implementations by weight format (devices/layers.py): a checkpoint whose linear layers are stored as
int8 with per-row scales loads into int8 parameters and decodes, token for token, as transformers does with
the same weights dequantized; every device's implementation of each format matches the reference's."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from engine_utils import generate_all, greedy
from helpers import hf_greedy

from lmdeploy.devices import get_device
from lmdeploy.devices.layers import FORMATS, REFERENCE_IMPLS, weight_format

LINEAR_NAMES = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')


def _int8_checkpoint(src: str, out: str, dense_out: str):
    """``src``'s linear layers as int8 + per-row scale (``out``), and the same weights dequantized as a plain
    checkpoint (``dense_out``), which transformers runs."""
    from safetensors.torch import load_file, save_file
    files = [f for f in os.listdir(src) if f.endswith('.safetensors')]
    for d in (out, dense_out):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns('*.safetensors'), dirs_exist_ok=True)
    for f in files:
        tensors = load_file(os.path.join(src, f))
        quant, dense = {}, {}
        for name, t in tensors.items():
            if name.endswith('.weight') and any(f'.{n}.' in name for n in LINEAR_NAMES):
                w = t.float()
                scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
                q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
                quant[name], quant[name + '_scale'] = q, scale
                dense[name] = (q.float() * scale[:, None]).to(t.dtype)
            else:
                quant[name] = dense[name] = t
        save_file(quant, os.path.join(out, f), metadata={'format': 'pt'})
        save_file(dense, os.path.join(dense_out, f), metadata={'format': 'pt'})
    cfg_path = os.path.join(out, 'config.json')
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg['quantization_config'] = {'quant_method': 'int8_per_channel'}
    with open(cfg_path, 'w') as fh:
        json.dump(cfg, fh)


@pytest.mark.parametrize('name', ['llama', 'qwen2'])
def test_int8_per_channel_checkpoint_decodes_as_its_dequantized_weights(tiny_model_factory, tmp_path, name):
    from lmdeploy.engine.engine import Engine
    from lmdeploy.messages import PytorchEngineConfig
    quant, dense = str(tmp_path / 'int8'), str(tmp_path / 'dense')
    _int8_checkpoint(tiny_model_factory(name), quant, dense)
    rng = random.Random()
    prompts = [[rng.randrange(20, 1000) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    eng = Engine(quant, PytorchEngineConfig(device_type='cpu', dtype='float32', session_len=256))
    try:
        layer = eng.runner.model.model.layers[0].self_attn.qkv_proj
        assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
        assert type(layer.impl).__name__ == 'Int8ChannelLinear'
        assert eng.runner.model.lm_head.weight.dtype == torch.float32  # the head stays plain
        got = generate_all(eng, prompts, greedy(10))
    finally:
        eng.close()
    assert got == hf_greedy(dense, prompts, 10)


def test_unknown_quantization_is_refused_by_name():
    assert weight_format(None) == 'dense'
    assert weight_format({'quant_method': 'int8_per_channel'}) == 'int8_channel'
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        weight_format({'quant_method': 'awq'})


@pytest.mark.parametrize('kind,fmt', sorted(REFERENCE_IMPLS))
def test_each_device_implements_each_format_as_the_reference(kind, fmt):
    """The conformance suite's layer check on the cpu device (every device's self-test, and check_env, run the
    same check for each format)."""
    from lmdeploy.devices.conformance import check_layer_impl
    assert fmt in set(FORMATS.values()) | {'dense'}
    ok, detail = check_layer_impl(get_device('cpu'), kind, fmt)
    assert ok, detail
