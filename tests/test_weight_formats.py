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
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        weight_format({'quant_method': 'bitsandbytes'})


@pytest.mark.parametrize('kind,fmt', sorted(REFERENCE_IMPLS))
def test_each_device_implements_each_format_as_the_reference(kind, fmt):
    """The conformance suite's layer check on the cpu device (every device's self-test, and check_env, run the
    same check for each format)."""
    from lmdeploy.devices.conformance import check_layer_impl
    # every format is one a checkpoint can name: a quant_method's own, or one its config picks (smooth_quant's
    # quant_dtype: int8 or fp8)
    configs = [c for c in getattr(REFERENCE_IMPLS[(kind, fmt)], 'example_configs', ()) if c]
    assert fmt in set(FORMATS.values()) | {'dense'} or any(weight_format(c) == fmt for c in configs)
    ok, detail = check_layer_impl(get_device('cpu'), kind, fmt)
    assert ok, detail


def test_a_device_gives_its_own_norm_embedding_and_lm_head(tiny_model_factory, monkeypatch):
    """Norms, the embedding and the LM head are layer implementations too: a device that lists its own
    (here one keeping the norm's scale in float32, as an NPU norm kernel may want, and counting calls) gets
    them used by every model, with nothing in the engine edited, and the tokens stay transformers'."""
    import collections

    from lmdeploy.devices.layers import DenseLinear, EmbeddingImpl, NormImpl, add_param
    from lmdeploy.engine.engine import Engine
    from lmdeploy.messages import PytorchEngineConfig
    calls = collections.Counter()

    class ScaleInFloat32(NormImpl):

        def create_weights(self, layer, dim):
            add_param(layer, 'weight', torch.ones(dim, dtype=torch.float32), keep_dtype=True)

        def apply(self, layer, x, eps, residual=None):
            calls['norm'] += 1
            return self.ops.rms_norm(x, layer.weight.to(x.dtype), eps, residual)

    class CountedEmbedding(EmbeddingImpl):

        def apply(self, layer, ids):
            calls['embedding'] += 1
            return super().apply(layer, ids)

    class CountedHead(DenseLinear):

        def apply(self, layer, x, with_bias=True):
            calls['lm_head'] += 1
            return super().apply(layer, x, with_bias)

    cpu = type(get_device('cpu'))
    monkeypatch.setattr(cpu, 'layer_impls', {**cpu.layer_impls, ('norm', 'dense'): ScaleInFloat32,
                                             ('embedding', 'dense'): CountedEmbedding,
                                             ('lm_head', 'dense'): CountedHead})
    path = tiny_model_factory('qwen2')
    rng = random.Random()
    prompts = [[rng.randrange(20, 1000) for _ in range(rng.randint(3, 20))] for _ in range(2)]
    eng = Engine(path, PytorchEngineConfig(device_type='cpu', dtype='float32', session_len=256))
    try:
        model = eng.runner.model
        assert isinstance(model.model.norm.impl, ScaleInFloat32) and isinstance(model.lm_head.impl, CountedHead)
        calls.clear()
        got = generate_all(eng, prompts, greedy(8))
    finally:
        eng.close()
    assert calls['norm'] > 0 and calls['embedding'] > 0 and calls['lm_head'] > 0, calls
    assert got == hf_greedy(path, prompts, 8)
