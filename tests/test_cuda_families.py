"""Issue 37's GPU criterion for the model families beyond Llama / Qwen2: bf16 logits against transformers.

For random-weight models of real 7-9B shapes (InternLM2.5-7B, Phi-3-mini-4k, Gemma-7B, GLM-4-9B), run on a GPU
in bf16: the first NEW greedy tokens of each prompt equal transformers' (bf16, same weights), or where they
diverge, the logits' relative error at every step up to and including the divergence is under 1e-2 (the
criterion and the ``rel`` of tests/test_cuda_e2e.py). Also, as there, we are no further from the float32
model's logits (on the bf16-chosen tokens) than transformers' own bf16 is.

Full width always; ``LMDEPLOY_FAMILY_LAYERS`` caps num_hidden_layers (default: the shape's own count with
``LMDEPLOY_TEST_FULL=1``, else 4). Each family's model is drawn on the GPU in bf16 by transformers, saved
(safetensors), run by transformers from memory (bf16 generation, then float32 on the same tokens), freed, then
converted to the family's checkpoint layout where it has one of its own and run by the Engine:

* InternLM2.5-7B: its modeling code is remote code, so the reference is a transformers Llama of its shape whose
  checkpoint helpers.llama_to_internlm2 renames and packs into InternLM2's ``wqkv`` (as tests/test_internlm.py);
  rope_theta 1e6 without InternLM2.5's dynamic NTK scaling (prompts stay within its trained length).
* Phi-3-mini-4k (Phi3ForCausalLM, its sliding_window 2047 longer than any prompt here), Gemma-7B
  (GemmaForCausalLM: head_dim 256 x 16 heads over hidden 3072, tied 256000-row head), GLM-4-9B (Glm4ForCausalLM:
  2 KV heads, q/k/v biases, rotary on the interleaved pairs of half of each head, post-norms).
* StarCoder2-7B (Starcoder2ForCausalLM: LayerNorms, GELU-tanh MLP, biases, 4096-token window on every layer),
  Falcon-7B (FalconForCausalLM, multi_query: 71 heads of 64 over one KV head) and Falcon-40B
  (new_decoder_architecture: 8 KV groups of 16 heads, ln_attn / ln_mlp); LayerNorm biases N(0, 0.05^2).
* Gemma2-9B (Gemma2ForCausalLM, included whenever engine/models registers it): 8 KV heads of 256, query_pre_attn
  scalar 256, alternating 4096-token sliding-window layers (longer than any prompt here), attention and final
  logit soft-capping, tied head.

The same code runs on cpu/float32 at tiny widths (test_family_harness_smoke_cpu, a few seconds): there tokens
must be equal and the logits agree to float32 rounding.

    python -m pytest -q -s tests/test_cuda_families.py                         # 4 layers each
    LMDEPLOY_TEST_FULL=1 python -m pytest -q -s tests/test_cuda_families.py    # full depth
"""
from __future__ import annotations

import gc
import os
import random
import shutil
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'benchmark'))

NEW = 8
GPU_PROMPT_LENGTHS = (5, 100, 700)
SMOKE_PROMPT_LENGTHS = (5, 20, 60)

# name -> (transformers config class, the real shape's fields, tiny fields for the cpu smoke (same quirks:
# GQA ratio or MHA, head_dim * heads against hidden, biases, partial rotary), checkpoint conversion or None)
FAMILIES = {
    'internlm2.5-7b': ('LlamaConfig',
                       dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=14336, vocab_size=92544, rope_theta=1000000.0,
                            max_position_embeddings=32768, rms_norm_eps=1e-5, attention_bias=False),
                       dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                            intermediate_size=256, vocab_size=512, max_position_embeddings=1024),
                       'internlm2'),
    'phi-3-mini-4k': ('Phi3Config',
                      dict(hidden_size=3072, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                           intermediate_size=8192, vocab_size=32064, rope_theta=10000.0, max_position_embeddings=4096,
                           original_max_position_embeddings=4096, sliding_window=2047, rms_norm_eps=1e-5),
                      dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           intermediate_size=128, vocab_size=512),
                      None),
    'gemma-7b': ('GemmaConfig',
                 dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
                      head_dim=256, intermediate_size=24576, vocab_size=256000, rope_theta=10000.0,
                      max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_act='gelu_pytorch_tanh',
                      tie_word_embeddings=True),
                 dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                      intermediate_size=128, vocab_size=512),
                 None),
    'glm-4-9b': ('Glm4Config',
                 dict(hidden_size=4096, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=2,
                      head_dim=128, intermediate_size=13696, vocab_size=151552, rope_theta=10000.0,
                      max_position_embeddings=32768, rms_norm_eps=1.5625e-07, attention_bias=True,
                      partial_rotary_factor=0.5, rope_scaling=dict(partial_rotary_factor=0.5)),
                 dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                      intermediate_size=256, vocab_size=512),
                 None),
}


# StarCoder2-7B (LayerNorms with biases, ungated GELU-tanh MLP, biases everywhere, a 4096-token window on every
# layer, longer than any prompt here), Falcon-7B (multi-query, parallel attention and MLP on one LayerNorm, erf
# GELU, head_dim 64 x 71 heads) and Falcon-40B (new_decoder_architecture: 8 KV groups of 16 query heads packed
# per group, ln_attn / ln_mlp)
FAMILIES.update({
    'starcoder2-7b': ('Starcoder2Config',
                      dict(hidden_size=4608, num_hidden_layers=32, num_attention_heads=36, num_key_value_heads=4,
                           intermediate_size=18432, vocab_size=49152, rope_theta=1000000.0, max_position_embeddings=16384,
                           norm_epsilon=1e-5, use_bias=True, hidden_act='gelu_pytorch_tanh', sliding_window=4096),
                      dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=512),
                      None),
    'falcon-7b': ('FalconConfig',
                  dict(hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
                       parallel_attn=True, new_decoder_architecture=False, bias=False, alibi=False, vocab_size=65024,
                       layer_norm_epsilon=1e-5, max_position_embeddings=2048),
                  dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512),
                  None),
    'falcon-40b': ('FalconConfig',
                   dict(hidden_size=8192, num_hidden_layers=60, num_attention_heads=128, num_kv_heads=8,
                        new_decoder_architecture=True, bias=False, alibi=False, vocab_size=65024,
                        layer_norm_epsilon=1e-5, max_position_embeddings=2048),
                   dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_kv_heads=2, vocab_size=512),
                   None),
})


def _gemma2_registered() -> bool:
    from lmdeploy.engine.models import ARCHITECTURES
    return 'Gemma2ForCausalLM' in ARCHITECTURES


if _gemma2_registered():
    FAMILIES['gemma2-9b'] = (
        'Gemma2Config',
        dict(hidden_size=3584, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
             intermediate_size=14336, vocab_size=256000, rope_theta=10000.0, max_position_embeddings=8192,
             rms_norm_eps=1e-6, hidden_activation='gelu_pytorch_tanh', tie_word_embeddings=True,
             query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
             final_logit_softcapping=30.0),
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             intermediate_size=128, vocab_size=512, query_pre_attn_scalar=32),
        None)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def family_layers(full: int) -> int:
    default = full if os.environ.get('LMDEPLOY_TEST_FULL') == '1' else 4
    return max(1, min(full, int(os.environ.get('LMDEPLOY_FAMILY_LAYERS', default))))


def family_config(family: str, tiny: bool, layers: int = None):
    """The transformers config of ``family``'s shape (tiny: its cpu smoke shape), ``layers`` deep."""
    from helpers import _make_config
    cls, full, small, _ = FAMILIES[family]
    kwargs = dict(full, **small) if tiny else dict(full)
    if layers is not None:
        kwargs['num_hidden_layers'] = layers
    kwargs.setdefault('tie_word_embeddings', False)
    return _make_config(cls, dict(kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=0))


def _randomize(model, seed: int) -> None:
    """benchmark/random_model.py's scheme (O(1) activations, so logits are not flat): norm multipliers
    1 + 0.1 N(0, 1), biases N(0, 0.05^2), embedding N(0, 1), projections N(0, 1 / fan_in), those writing to the
    residual also / sqrt(2 layers); and an untied head 3x that (logit std ~3, so greedy margins are not all
    within bf16's noise). Gemma stores each norm's multiplier less 1, and multiplies its embedding by
    sqrt(hidden): the embedding is stored that much smaller (the residual stream starts at O(1), as the others'),
    and its tied head, rows of std 1 / sqrt(hidden), reads a final norm of multiplier ~3 for the same logit std."""
    cfg = model.config
    gemma = cfg.model_type.startswith('gemma')
    depth = cfg.num_hidden_layers
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)

    def randn(p):
        return torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ('norm' in name or '.ln_' in name or name.startswith('transformer.ln_f')) and name.endswith('.bias'):
                val = 0.05 * randn(p)  # a LayerNorm's (StarCoder2, Falcon)
            elif 'norm' in name or '.ln_' in name or name.startswith('transformer.ln_f'):
                val = 1.0 + 0.1 * randn(p)
                if gemma and name == 'model.norm.weight':
                    val = val * 3.0
                if gemma:
                    val = val - 1.0
            elif p.ndim == 1:
                val = 0.05 * randn(p)
            elif 'embed_tokens' in name or 'word_embeddings' in name:
                val = randn(p) / (cfg.hidden_size**0.5 if gemma else 1.0)
            elif 'lm_head' in name:
                val = 3.0 * randn(p) / p.shape[-1]**0.5
            elif any(part in name for part in ('o_proj', 'down_proj', 'c_proj', '.dense.', 'dense_4h_to_h')):
                val = randn(p) / p.shape[-1]**0.5 / (2 * depth)**0.5
            else:
                val = randn(p) / p.shape[-1]**0.5
            p.copy_(val.to(p.dtype))


def build_family(family: str, out: str, device: str, dtype: torch.dtype, tiny: bool, layers: int = None, seed=0):
    """(transformers model on ``device`` in ``dtype``, its saved checkpoint directory)."""
    import transformers
    from random_model import write_tokenizer
    cfg = family_config(family, tiny, layers)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    _randomize(model, seed)
    model.eval()
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, max_shard_size='1000GB')  # one file: helpers' converters read model.safetensors
    write_tokenizer(out, cfg.vocab_size)
    return model, out


def engine_checkpoint(family: str, src: str, out: str) -> str:
    """The checkpoint the Engine loads: ``src`` itself, or converted to the family's own layout."""
    convert = FAMILIES[family][3]
    if convert is None:
        return src
    from helpers import llama_to_internlm2
    assert convert == 'internlm2', convert
    return llama_to_internlm2(src, out)


def hf_reference(model, prompts, truth_too: bool):
    """Per prompt: [greedy tokens, their step logits, the float32 model's logits on the same tokens or None].
    ``truth_too`` turns the model into float32 (in place) for the last."""
    device = next(model.parameters()).device
    out = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW,
                               do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                               eos_token_id=None)
        out.append([g.sequences[0, len(ids):].tolist(), torch.cat(g.logits).float().cpu(), None])
    if truth_too:
        model.float()
        for ids, entry in zip(prompts, out):
            with torch.no_grad():
                full = torch.tensor([ids + entry[0]], device=device)
                entry[2] = model(full).logits[0, len(ids) - 1:len(ids) - 1 + NEW].float().cpu()
    return out


def engine_run(path, prompts, device: str, dtype: str):
    """Per prompt: (greedy tokens, their step logits) from the Engine, all prompts in one batch."""
    from lmdeploy.engine.engine import Engine
    from lmdeploy.messages import PytorchEngineConfig
    session_len = max(len(p) for p in prompts) + NEW + 64
    if device == 'cuda':
        cfg = PytorchEngineConfig(device_type='cuda', dtype=dtype, session_len=session_len, cache_max_entry_count=0.2,
                                  block_size=64)
    else:
        blocks = sum(-(-(len(p) + NEW) // 16) for p in prompts) + 8
        cfg = PytorchEngineConfig(device_type=device, dtype=dtype, session_len=session_len, block_size=16,
                                  num_gpu_blocks=blocks)
    return greedy_with_logits(Engine(path, cfg), prompts, NEW)


def greedy_with_logits(engine, prompts, new: int):
    """Per prompt: (``new`` greedy tokens, their step logits), all prompts in one batch of ``engine``, which is
    checked clean and closed afterwards."""
    from engine_utils import submit

    from lmdeploy.engine.sequence import SamplingParams
    try:
        cols = [submit(engine, p, SamplingParams(max_new_tokens=new, output_logits='generation')) for p in prompts]
        got = []
        for col in cols:
            col.wait(600)
            assert col.final.error is None, col.final.error
            logits = torch.cat([o.logits for o in col.outputs if o.logits is not None]).float().cpu()
            assert logits.shape[0] == new, logits.shape
            got.append((col.token_ids, logits))
        engine.wait_idle()
        engine.check_invariants()
        return got
    finally:
        engine.close()


def compare(ref, got):
    """Per prompt: (tokens equal to the reference's, max logits rel err vs it over the steps up to and including
    the first divergence, ours vs float32, reference vs float32 (None without a float32 run))."""
    rows = []
    for (want, want_logits, truth), (tokens, logits) in zip(ref, got):
        same = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), NEW)
        steps = range(min(same + 1, NEW))  # contexts identical to the reference's
        err = max(rel(logits[i], want_logits[i]) for i in steps)
        ours = theirs = None
        if truth is not None:
            ours = max(rel(logits[i], truth[i]) for i in steps)
            theirs = max(rel(want_logits[i], truth[i]) for i in steps)
        rows.append((same, err, ours, theirs))
    return rows


def run_family(family: str, root: str, device: str, dtype: torch.dtype, tiny: bool, layers: int, lengths):
    """Build, reference, free, convert, run the Engine; the rows of ``compare`` and a printable line."""
    t0 = time.perf_counter()
    vocab = family_config(family, tiny, layers).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    src = os.path.join(root, 'hf')
    model, _ = build_family(family, src, device, dtype, tiny, layers)
    t_build = time.perf_counter()
    ref = hf_reference(model, prompts, truth_too=dtype != torch.float32)
    del model
    gc.collect()
    if device == 'cuda':
        torch.cuda.empty_cache()
    t_ref = time.perf_counter()
    path = engine_checkpoint(family, src, os.path.join(root, 'converted'))
    if path != src:
        shutil.rmtree(src)
    got = engine_run(path, prompts, device, str(dtype).split('.')[-1])
    t_engine = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    rows = compare(ref, got)
    full = FAMILIES[family][1]['num_hidden_layers']

    def f(x):
        return '-' if x is None else f'{x:.2e}'
    line = (f'[{family} {layers}/{full} layers {device} {str(dtype).split(".")[-1]}] per prompt of '
            f'{"/".join(map(str, lengths))} tokens: (tokens of {NEW} equal to transformers, max logits rel err vs '
            'it, ours vs fp32, transformers vs fp32): ' + ', '.join(f'({r[0]}, {f(r[1])}, {f(r[2])}, {f(r[3])})'
                                                                    for r in rows)
            + f'; build+save {t_build - t0:.0f}s, transformers {t_ref - t_build:.0f}s, engine {t_engine - t_ref:.0f}s')
    return rows, line


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
@pytest.mark.parametrize('family', list(FAMILIES))
def test_family_bf16_logits_match_transformers(family, tmp_path):
    layers = family_layers(FAMILIES[family][1]['num_hidden_layers'])
    rows, line = run_family(family, str(tmp_path / family), 'cuda', torch.bfloat16, tiny=False, layers=layers,
                            lengths=GPU_PROMPT_LENGTHS)
    print('\n' + line)
    torch.cuda.empty_cache()
    for same, err, ours, theirs in rows:
        # the criterion: all NEW tokens match, or the logits agree until they diverge
        assert same == NEW or err < 1e-2, line
        # and we are no further from the float32 truth than transformers' own bf16 (as test_cuda_e2e)
        assert ours <= 1.25 * theirs + 1e-3, line


@pytest.mark.parametrize('family', list(FAMILIES))
def test_family_harness_smoke_cpu(family, tmp_path):
    """The GPU test's code at tiny widths on cpu/float32: the conversion, config and comparison are right (equal
    tokens, logits equal to float32 rounding)."""
    rows, line = run_family(family, str(tmp_path / family), 'cpu', torch.float32, tiny=True, layers=2,
                            lengths=SMOKE_PROMPT_LENGTHS)
    print('\n' + line)
    for same, err, _, _ in rows:
        assert same == NEW and err < 1e-4, line
