"""Gemma (v1, GemmaForCausalLM) on cpu/float32 decodes token for token as transformers does.

Tiny random Gemma models built with transformers' GemmaConfig (helpers.build_tiny_gemma): hidden 64, 2
layers, 4 query heads of head_dim 32 (head_dim * heads = 128 != hidden, as Gemma 7B's 16 x 256 over 3072),
MQA (1 KV head, as Gemma 2B) and GQA (2 KV heads), tied head, gelu_pytorch_tanh, norm weights stored around 0
so that RMSNorm's (1 + w) matters. Also the pieces that make Gemma Gemma, each against transformers' own
module: the offset RMSNorm (exact in float32; bf16 documented in nn/norm.OffsetRMSNorm), the embedding scale
in the model's dtype and the activation.
"""
from __future__ import annotations

import random

import pytest
import torch
from engine_utils import generate_all, greedy
from helpers import build_tiny_gemma, hf_greedy

from lmdeploy.devices import get_device
from lmdeploy.engine.engine import Engine
from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import get_model_class
from lmdeploy.engine.models.gemma import GemmaForCausalLM
from lmdeploy.engine.nn.build import building
from lmdeploy.engine.nn.loading import CheckpointTensor
from lmdeploy.messages import PytorchEngineConfig

NEW_TOKENS = 16
PROMPT_LENGTHS = (3, 17, 41)


def _prompts(seed=11):
    rng = random.Random(seed)
    return [[rng.randrange(20, 49152) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope='module')
def gemma(smollm2_path, tmp_path_factory):
    """kv heads -> (checkpoint, transformers' greedy tokens for _prompts())."""
    root = tmp_path_factory.mktemp('gemma')
    made = {}

    def get(kv):
        if kv not in made:
            path = build_tiny_gemma(str(root / f'gemma_kv{kv}'), smollm2_path, num_kv_heads=kv)
            made[kv] = path, hf_greedy(path, _prompts(), NEW_TOKENS)
        return made[kv]

    return get


def _engine_tokens(path, prompts, tp=1):
    engine = Engine(path, PytorchEngineConfig(device_type='cpu', dtype='float32', tp=tp, session_len=256,
                                              block_size=16, num_gpu_blocks=48))
    try:
        return generate_all(engine, prompts, greedy(NEW_TOKENS))
    finally:
        engine.close()


@pytest.mark.parametrize('kv', [1, 2])
def test_gemma_decodes_as_transformers(kv, gemma):
    path, want = gemma(kv)
    cfg = load_model_config(path)
    assert get_model_class(cfg) is GemmaForCausalLM and cfg.head_dim == 32 and cfg.num_kv_heads == kv
    got = _engine_tokens(path, _prompts())
    assert got == want
    assert len({t for seq in want for t in seq}) > 8  # not a degenerate repeat


def test_gemma_tp2_equals_transformers(gemma):
    """Two ranks on gloo: 2 query heads and 1 KV head each, half the MLP, half the (scaled) embedding."""
    path, want = gemma(2)
    assert _engine_tokens(path, _prompts(), tp=2) == want


def test_offset_rms_norm_matches_transformers():
    """The folded (1 + w) in float32 is bit for bit transformers' GemmaRMSNorm; in bf16 it stays within 2
    ulps of it (the documented difference: Llama's rounding order)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from lmdeploy.engine.nn.norm import OffsetRMSNorm
    g = torch.Generator().manual_seed(0)
    w = 0.3 * torch.randn(64, generator=g)
    x = 3 * torch.randn(9, 64, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        hf = GemmaRMSNorm(64, eps=1e-6).to(dtype)
        with torch.no_grad():
            hf.weight.copy_(w)
        with building(get_device('cpu')):
            mine = OffsetRMSNorm(64, 1e-6).to(dtype)
        mine.load_param('weight', '', CheckpointTensor(w.to(dtype), dtype))
        want, got = hf(x.to(dtype)), mine(x.to(dtype))
        assert got.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            # two more roundings: within 2 ulps (a bf16 ulp is at most 2^-7 of the value)
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=0)


def test_gelu_tanh_and_mul_is_transformers_activation():
    from transformers.activations import ACT2FN
    g = torch.Generator().manual_seed(1)
    x = 4 * torch.randn(5, 2 * 24, generator=g)
    ops = get_device('cpu')
    want = ACT2FN['gelu_pytorch_tanh'](x[:, :24]) * x[:, 24:]
    assert torch.equal(ops.gelu_tanh_and_mul(x), want)


def test_embedding_scale_is_rounded_to_the_model_dtype(gemma):
    """sqrt(2048) = 45.2548... is 45.25 in bf16; transformers multiplies by that."""
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

    from lmdeploy.engine.models.gemma import GemmaModel
    path, _ = gemma(1)
    cfg = load_model_config(path)
    cfg.hidden_size = 2048
    with torch.device('meta'), building(get_device('cpu')):
        model = GemmaModel(cfg)
    assert model.embed_scale == 2048**0.5
    hf = GemmaTextScaledWordEmbedding(10, 4, 0, embed_scale=2048**0.5).to(torch.bfloat16)
    ids = torch.arange(10)
    x = hf.weight.detach()[ids]
    assert torch.equal(hf(ids), x * float(torch.tensor(2048**0.5).to(torch.bfloat16)))


def test_other_activations_are_refused(gemma):
    path, _ = gemma(1)
    cfg = load_model_config(path)
    cfg.raw = dict(cfg.raw, hidden_act='silu', hidden_activation=None)
    with pytest.raises(ValueError, match="hidden_activation 'silu'"):
        with torch.device('meta'), building(get_device('cpu')):
            GemmaForCausalLM(cfg)
