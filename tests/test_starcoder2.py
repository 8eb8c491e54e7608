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

import pytest
from engine_utils import engine_tokens, generate_all, greedy
from helpers import build_tiny_starcoder2, edited_copy, hf_greedy, lively_model, random_prompts

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.starcoder2 import Starcoder2ForCausalLM
from lmdeploy.messages import PytorchEngineConfig

NEW_TOKENS = 16
CONFIG = dict(device_type='cpu', dtype='float32', session_len=256, block_size=4, num_gpu_blocks=128)
WINDOW = 6
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=2, rope_theta=10000.0)
SPECS = {
    'window': dict(BASE, use_bias=True, hidden_act='gelu_pytorch_tanh', tie_word_embeddings=True,
                   sliding_window=WINDOW),
    'plain': dict(BASE, use_bias=False, hidden_act='gelu', tie_word_embeddings=False, sliding_window=None),
}


@pytest.fixture(scope='module')
def models(smollm2_path, tmp_path_factory):
    root = tmp_path_factory.mktemp('starcoder2')
    made = {}

    def get(name):
        if name not in made:
            made[name] = lively_model(lambda seed: build_tiny_starcoder2(str(root / f'{name}-{seed}'), smollm2_path,
                                                                         SPECS[name], seed), new_tokens=NEW_TOKENS)
        return made[name]

    return get


def _tokens(path, prompts, **kw):
    return engine_tokens(path, prompts, NEW_TOKENS, **dict(CONFIG, **kw))


@pytest.mark.parametrize('name', ['window', 'plain'])
def test_starcoder2_decodes_as_transformers(name, models):
    path, seed = models(name)
    cfg = load_model_config(path)
    assert get_model_class(cfg) is Starcoder2ForCausalLM
    assert (cfg.sliding_window, cfg.attention_bias, cfg.tie_word_embeddings) == (
        (WINDOW, True, True) if name == 'window' else (None, False, False))
    prompts = random_prompts(seed)
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
    other = edited_copy(path, str(tmp_path / 'full'), sliding_window=4096)
    prompts = random_prompts(seed)
    assert hf_greedy(other, prompts, NEW_TOKENS) != hf_greedy(path, prompts, NEW_TOKENS)


def test_starcoder2_tp2_equals_transformers(models):
    """Two ranks on gloo: each holds one KV head with its query heads, half of c_fc's rows and c_proj's
    columns (c_proj's bias added once, after the sum)."""
    path, seed = models('window')
    prompts = random_prompts(seed)
    assert _tokens(path, prompts, tp=2) == hf_greedy(path, prompts, NEW_TOKENS)


def test_starcoder2_on_the_emulated_ascend_device(models, emulated_npu):
    """The ascend device's layer_norm and npu_gelu (tanh) and its windowed attention, in a model, on the
    torch_npu emulation: transformers' tokens (computed before the emulation is switched on)."""
    path, seed = models('window')
    prompts = random_prompts(seed)
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
