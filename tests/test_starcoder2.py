"""StarCoder2 (``Starcoder2ForCausalLM``) on cpu / float32 decodes token for token as transformers does.

Tiny random models from transformers' own Starcoder2Config (hidden 64, 2 layers, 4 query heads of 16 over 2 KV
heads, LayerNorms with biases, ungated GELU MLP):

* ``window``: biases everywhere (``use_bias``), gelu_pytorch_tanh, tied head, a 6-token sliding window on
  every layer, far shorter than the 41-token prompt; whole prompts, and prompts prefilled in 5-token chunks
  through a cache of 40 tokens (the blocks behind the window given back);
* ``plain``: no biases, erf ``gelu``, an untied head, no window.

The same weights decode otherwise in transformers without the window, so the window is what they match on.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from engine_utils import generate_all, greedy
from helpers import _copy_tokenizer, _make_config, _randomize, hf_greedy

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.starcoder2 import Starcoder2ForCausalLM
from lmdeploy.messages import PytorchEngineConfig

NEW_TOKENS = 16
WINDOW = 6
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=2, rope_theta=10000.0)
SPECS = {
    'window': dict(BASE, use_bias=True, hidden_act='gelu_pytorch_tanh', tie_word_embeddings=True,
                   sliding_window=WINDOW),
    'plain': dict(BASE, use_bias=False, hidden_act='gelu', tie_word_embeddings=False, sliding_window=None),
}


def build_tiny_starcoder2(out: str, tokenizer_dir: str, kwargs: dict, seed: int) -> str:
    from transformers import AutoModelForCausalLM
    cfg = _make_config('Starcoder2Config', kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'norm' in name and name.endswith('.bias'):  # _randomize gives every norm parameter ~1
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    _copy_tokenizer(tokenizer_dir, out)
    return out


def _prompts(seed):
    rng = random.Random(seed)
    return [[rng.randrange(20, 49152) for _ in range(n)] for n in (3, 17, 41)]


@pytest.fixture(scope='module')
def models(smollm2_path, tmp_path_factory):
    root = tmp_path_factory.mktemp('starcoder2')
    seed = int.from_bytes(os.urandom(2), 'little')
    made = {}

    def get(name):
        if name not in made:
            made[name] = build_tiny_starcoder2(str(root / name), smollm2_path, SPECS[name], seed), seed
        return made[name]

    return get


def _tokens(path, prompts, **kw):
    cfg = dict(device_type='cpu', dtype='float32', session_len=256, block_size=4, num_gpu_blocks=128)
    engine = Engine(path, PytorchEngineConfig(**dict(cfg, **kw)))
    try:
        return generate_all(engine, prompts, greedy(NEW_TOKENS))
    finally:
        engine.close()


@pytest.mark.parametrize('name', ['window', 'plain'])
def test_starcoder2_decodes_as_transformers(name, models):
    path, seed = models(name)
    cfg = load_model_config(path)
    assert get_model_class(cfg) is Starcoder2ForCausalLM
    assert (cfg.sliding_window, cfg.attention_bias, cfg.tie_word_embeddings) == (
        (WINDOW, True, True) if name == 'window' else (None, False, False))
    prompts = _prompts(seed)
    want = hf_greedy(path, prompts, NEW_TOKENS)
    assert len({t for seq in want for t in seq}) > 8  # not a degenerate repeat
    assert _tokens(path, prompts) == want
    if name == 'window':
        # chunks of 5 crossing the window's edge, through 10 blocks of 4 tokens (40) for sequences of up to 57:
        # every layer has the window, so the blocks behind it are given back (scheduler._slide)
        engine = Engine(path, PytorchEngineConfig(device_type='cpu', dtype='float32', session_len=256, block_size=4,
                                                  num_gpu_blocks=10, max_prefill_token_num=5))
        try:
            assert engine.scheduler.kv_window == WINDOW
            assert generate_all(engine, prompts, greedy(NEW_TOKENS)) == want
            engine.scheduler.check_invariants()
        finally:
            engine.close()


def test_starcoder2_window_bites(models, tmp_path):
    """The same weights with the window past every sequence decode otherwise in transformers."""
    path, seed = models('window')
    other = str(tmp_path / 'full')
    shutil.copytree(path, other)
    with open(os.path.join(other, 'config.json')) as f:
        saved = json.load(f)
    with open(os.path.join(other, 'config.json'), 'w') as f:
        json.dump(dict(saved, sliding_window=4096), f)
    prompts = _prompts(seed)
    assert hf_greedy(other, prompts, NEW_TOKENS) != hf_greedy(path, prompts, NEW_TOKENS)


def test_starcoder2_tp2_equals_transformers(models):
    """Two ranks on gloo: each holds one KV head with its query heads, half of c_fc's rows and c_proj's
    columns (c_proj's bias added once, after the sum)."""
    path, seed = models('window')
    prompts = _prompts(seed)
    assert _tokens(path, prompts, tp=2) == hf_greedy(path, prompts, NEW_TOKENS)


@pytest.fixture
def emulated_npu():
    """tests/npu_emulation's torch_npu active for one test (as test_ascend_emulated's ``npu``)."""
    import sys
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'npu_emulation')
    sys.path.insert(0, here)
    try:
        import activate
    finally:
        sys.path.remove(here)
    yield activate


def test_starcoder2_on_the_emulated_ascend_device(models, emulated_npu):
    """The ascend device's layer_norm and npu_gelu (tanh) and its windowed attention, in a model, on the
    torch_npu emulation: transformers' tokens (computed before the emulation is switched on)."""
    path, seed = models('window')
    prompts = _prompts(seed)
    want = hf_greedy(path, prompts, NEW_TOKENS)
    emulated_npu.activate()
    try:
        import torch_npu
        calls, gelu = [], torch_npu.npu_gelu
        torch_npu.npu_gelu = lambda x, approximate='none': (calls.append(approximate), gelu(x, approximate))[1]
        assert _tokens(path, prompts, device_type='ascend', eager_mode=True) == want
        assert calls and set(calls) == {'tanh'}  # the device's own GELU ran, in the model's form
    finally:
        emulated_npu.deactivate()
