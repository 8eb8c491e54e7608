"""ALiBi models on cpu / float32, token for token against a reference:

* Falcon-RW (transformers' FalconForCausalLM with ``alibi``: one q, k, v per head, attention then MLP, biases)
  against transformers itself (its SDPA path: slopes scaled with the scores), on one rank and on two (gloo: each
  rank holds its heads' slopes);
* Baichuan-13B / Baichuan2-13B (``BaichuanForCausalLM`` with hidden size 5120: ALiBi instead of rotary, W_pack,
  Baichuan2's normalised head). transformers has no Baichuan class (its modeling file is remote code), so the
  reference is the model's equations written out here in plain torch from the checkpoint's tensors: RMSNorm,
  softmax(q k^T / sqrt(d) + m_h j + causal mask) v with Baichuan's slopes m_h times key positions j (its
  ``_gen_alibi_mask``), the SiLU-gated MLP, logits over the head's unit rows. The model is 1 layer of the real
  width (40 heads of 128) over a small vocabulary and MLP.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from engine_utils import engine_tokens
from helpers import build_tiny_falcon, hf_greedy, lively_model, random_prompts

from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.nn.attention import alibi_slopes

NEW_TOKENS = 12
CONFIG = dict(device_type='cpu', dtype='float32', session_len=256, block_size=4, num_gpu_blocks=96)
FALCON_RW = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=128,
                 max_position_embeddings=512, layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                 alibi=True, new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True,
                 tie_word_embeddings=False)


@pytest.fixture(scope='module')
def falcon_rw(smollm2_path, tmp_path_factory):
    root = tmp_path_factory.mktemp('falcon_rw')

    def prompts_of(seed):
        return random_prompts(seed, lengths=(3, 17, 60))

    path, seed = lively_model(lambda seed: build_tiny_falcon(str(root / f'm-{seed}'), smollm2_path, FALCON_RW, seed),
                              prompts_of, NEW_TOKENS)
    prompts = prompts_of(seed)
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def test_falcon_rw_decodes_as_transformers(falcon_rw):
    path, prompts, want = falcon_rw
    assert len({t for seq in want for t in seq}) > 8  # not a degenerate repeat
    assert engine_tokens(path, prompts, NEW_TOKENS, **CONFIG) == want


def test_falcon_rw_tp2_equals_transformers(falcon_rw):
    path, prompts, want = falcon_rw
    assert engine_tokens(path, prompts, NEW_TOKENS, **dict(CONFIG, tp=2)) == want


def test_alibi_bias_changes_the_answer(falcon_rw, tmp_path):
    """The same weights read as a rotary Falcon give other tokens: the biases are what the reference uses."""
    path, prompts, want = falcon_rw
    rotary = str(tmp_path / 'rotary')
    os.makedirs(rotary)
    for name in os.listdir(path):
        os.symlink(os.path.join(path, name), os.path.join(rotary, name))
    os.remove(os.path.join(rotary, 'config.json'))
    with open(os.path.join(path, 'config.json')) as f:
        cfg = dict(json.load(f), alibi=False)
    with open(os.path.join(rotary, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    assert engine_tokens(rotary, prompts, NEW_TOKENS, **CONFIG) != want


# ------------------------------------------------------------------------------------------ Baichuan-13B
HIDDEN, HEADS, FFN, VOCAB, LAYERS = 5120, 40, 64, 512, 1


def _baichuan_13b(out: str, seed: int):
    """A 1-layer Baichuan2-13B-shaped checkpoint with random weights (O(1) activations), and its tensors."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    t = {'model.embed_tokens.weight': randn(VOCAB, HIDDEN), 'model.norm.weight': 1 + 0.1 * randn(HIDDEN),
         'lm_head.weight': randn(VOCAB, HIDDEN, scale=3 / math.sqrt(HIDDEN))}
    for i in range(LAYERS):
        p = f'model.layers.{i}.'
        t[p + 'input_layernorm.weight'] = 1 + 0.1 * randn(HIDDEN)
        t[p + 'post_attention_layernorm.weight'] = 1 + 0.1 * randn(HIDDEN)
        # q, k scaled up so that the scores spread (several units), as a trained model's do
        t[p + 'self_attn.W_pack.weight'] = torch.cat([randn(HIDDEN, HIDDEN, scale=4 / math.sqrt(HIDDEN)),
                                                      randn(HIDDEN, HIDDEN, scale=4 / math.sqrt(HIDDEN)),
                                                      randn(HIDDEN, HIDDEN, scale=1 / math.sqrt(HIDDEN))])
        t[p + 'self_attn.o_proj.weight'] = randn(HIDDEN, HIDDEN, scale=1 / math.sqrt(HIDDEN))
        t[p + 'mlp.gate_proj.weight'] = randn(FFN, HIDDEN, scale=1 / math.sqrt(HIDDEN))
        t[p + 'mlp.up_proj.weight'] = randn(FFN, HIDDEN, scale=1 / math.sqrt(HIDDEN))
        t[p + 'mlp.down_proj.weight'] = randn(HIDDEN, FFN, scale=1 / math.sqrt(FFN))
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(out, 'model.safetensors'))
    cfg = dict(architectures=['BaichuanForCausalLM'], model_type='baichuan', hidden_size=HIDDEN,
               intermediate_size=FFN, num_attention_heads=HEADS, num_hidden_layers=LAYERS, vocab_size=VOCAB,
               model_max_length=4096, rms_norm_eps=1e-6, hidden_act='silu', bos_token_id=1, eos_token_id=2,
               pad_token_id=0, tie_word_embeddings=False, torch_dtype='float32')
    with open(os.path.join(out, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    return t


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _baichuan_13b_logits(t, ids):
    """The last position's logits: Baichuan-13B's forward, written out (see the module's docstring)."""
    d = HIDDEN // HEADS
    n = len(ids)
    slopes = torch.tensor(alibi_slopes(HEADS))
    j = torch.arange(n, dtype=torch.float32)
    mask = torch.full((n, n), float('-inf')).triu(1)
    bias = slopes[:, None, None] * j[None, None, :] + mask  # Baichuan's mask: slope times the key's position
    x = t['model.embed_tokens.weight'][ids]
    for i in range(LAYERS):
        p = f'model.layers.{i}.'
        h = _rms(x, t[p + 'input_layernorm.weight'])
        q, k, v = (h @ t[p + 'self_attn.W_pack.weight'].T).view(n, 3, HEADS, d).unbind(1)
        s = torch.einsum('qhd,khd->hqk', q, k) / math.sqrt(d) + bias
        a = torch.einsum('hqk,khd->qhd', s.softmax(-1), v).reshape(n, HIDDEN)
        x = x + a @ t[p + 'self_attn.o_proj.weight'].T
        h = _rms(x, t[p + 'post_attention_layernorm.weight'])
        gate, up = h @ t[p + 'mlp.gate_proj.weight'].T, h @ t[p + 'mlp.up_proj.weight'].T
        x = x + (torch.nn.functional.silu(gate) * up) @ t[p + 'mlp.down_proj.weight'].T
    head = torch.nn.functional.normalize(t['lm_head.weight'], dim=-1)  # Baichuan2's NormHead
    return _rms(x[-1], t['model.norm.weight']) @ head.T


def test_baichuan_13b_decodes_as_its_equations(tmp_path):
    seed = int.from_bytes(os.urandom(2), 'little')
    path = str(tmp_path / 'baichuan13b')
    t = _baichuan_13b(path, seed)
    cfg = load_model_config(path)
    assert (cfg.num_heads, cfg.head_dim) == (HEADS, 128)
    prompts = [p for p in random_prompts(seed, lengths=(5, 30))]
    prompts = [[x % VOCAB for x in p] for p in prompts]
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(6):
                ids.append(int(_baichuan_13b_logits(t, torch.tensor(ids)).argmax()))
            want.append(ids[len(p):])
    got = engine_tokens(path, prompts, 6, **dict(CONFIG, num_gpu_blocks=32))
    assert got == want
