"""Issue 36's GPU criterion for tensor parallelism: tp=2 and tp=4 against tp=1 on the GPU, in bf16.

Random-weight models of a Llama-3-8B shape and a Qwen2-7B shape (q/k/v biases; its 28 heads over 4 KV heads
split 14/2 on two GPUs and 7/1 on four), full width, ``LMDEPLOY_TP_LAYERS`` layers (default 4): the greedy tokens
of a batch of prompts at tp=N equal tp=1's, or where they diverge the logits' relative error at every step up to
and including the divergence is under 1e-2 (the ranks sum their shards' bf16 partial results, in another order
than one GPU's GEMM). With the 16-bit, int8 and int4 KV caches, each against tp=1 with the same cache; with a
quantized cache the error allowed is that cache's own at tp=1, where larger (quantized_bounds: int4's rounding
turns those small differences into logits up to ~3e-2 apart on the shortest prompt).

The first tp engine of the process sums small messages in one shot through peer buffers
(lmdeploy/devices/cuda/peer_all_reduce.py); later ones, whose process group reuses the first one's name, through
NCCL.

Skipped without 2 GPUs (tp=4 without 4); the CPU's tensor parallelism (gloo) is tests/test_tensor_parallel.py's.

    python -m pytest -q -s tests/test_cuda_tp.py
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from test_cuda_families import _randomize, greedy_with_logits, rel

NEW = 12
PROMPT_LENGTHS = (5, 37, 100, 300, 700, 1500)

SHAPES = {
    'llama3-8b': ('LlamaConfig',
                  dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                       vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)),
    'qwen2-7b': ('Qwen2Config',
                 dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                      vocab_size=152064, rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6)),
}

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
_TP1 = {}  # (shape, quant_policy) -> tp=1's run, shared by tp=2 and tp=4


def build(shape: str, out: str) -> str:
    import transformers
    from helpers import _make_config

    from random_model import write_tokenizer  # benchmark/ (test_cuda_families puts it on the path)
    cls, fields = SHAPES[shape]
    layers = int(os.environ.get('LMDEPLOY_TP_LAYERS', 4))
    cfg = _make_config(cls, dict(fields, num_hidden_layers=layers, tie_word_embeddings=False, bos_token_id=1,
                                 eos_token_id=2, pad_token_id=0))
    with torch.device('cuda'):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    _randomize(model, 0)
    model.save_pretrained(out)
    write_tokenizer(out, cfg.vocab_size)
    del model
    torch.cuda.empty_cache()
    return out


def run(path: str, tp: int, quant_policy: int, prompts, executor=None):
    """Per prompt: (greedy tokens, their step logits), all prompts in one batch."""
    from lmdeploy.engine.engine import Engine
    from lmdeploy.messages import PytorchEngineConfig
    cfg = PytorchEngineConfig(device_type='cuda', dtype='bfloat16', tp=tp, quant_policy=quant_policy,
                              session_len=max(map(len, prompts)) + NEW + 64, max_batch_size=16,
                              cache_max_entry_count=0.3, distributed_executor_backend=executor)
    return greedy_with_logits(Engine(path, cfg), prompts, NEW)


def compare(ref, got):
    """Per prompt: (steps before the first different token, max logits rel err over the steps up to and
    including it)."""
    rows = []
    for (want, want_logits), (tokens, logits) in zip(ref, got):
        same = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), NEW)
        rows.append((same, max(rel(logits[i], want_logits[i]) for i in range(min(same + 1, NEW)))))
    return rows


@pytest.fixture(scope='module', params=sorted(SHAPES))
def model_dir(request, tmp_path_factory):
    if GPUS < 2:
        pytest.skip('needs 2 CUDA GPUs')
    return request.param, build(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.mark.parametrize('quant_policy', [0, 8, 4])
@pytest.mark.parametrize('tp', [2, 4])
def test_tp_equals_tp1_on_gpus(model_dir, tp, quant_policy):
    if GPUS < tp:
        pytest.skip(f'needs {tp} CUDA GPUs')
    shape, path = model_dir
    rng = random.Random(0)
    vocab = SHAPES[shape][1]['vocab_size']
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    for policy in {0, quant_policy}:
        if (shape, policy) not in _TP1:
            _TP1[shape, policy] = run(path, 1, policy, prompts)
    ref = _TP1[shape, quant_policy]
    rows = compare(ref, run(path, tp, quant_policy, prompts))
    bounds = quantized_bounds(_TP1[shape, 0], ref)
    print(f'\n[tp on GPUs] {shape}, tp={tp}, quant_policy={quant_policy}: (tokens of {NEW} equal to tp=1, '
          f'max logits rel err up to the first difference, bound) per prompt: '
          + ', '.join(f'({s}, {e:.2e}, {b:.2e})' for (s, e), b in zip(rows, bounds)))
    for (same, err), bound in zip(rows, bounds):  # equal tokens, or logits that agree up to where they part
        assert same == NEW or err < bound, (rows, bounds)


def test_ray_executor_on_gpus_equals_tp1(model_dir):
    """tp=2 with each rank a Ray actor on its GPU (a local Ray instance; every GPU of the node in view of each
    rank, its own picked by index): the greedy tokens of tp=1, or logits within 1e-2 up to where they part."""
    ray = pytest.importorskip('ray')
    shape, path = model_dir
    rng = random.Random(0)
    prompts = [[rng.randrange(3, SHAPES[shape][1]['vocab_size']) for _ in range(n)] for n in PROMPT_LENGTHS]
    if (shape, 0) not in _TP1:
        _TP1[shape, 0] = run(path, 1, 0, prompts)
    try:
        rows = compare(_TP1[shape, 0], run(path, 2, 0, prompts, executor='ray'))
    finally:
        ray.shutdown()
    print(f'\n[tp on GPUs, Ray] {shape}, tp=2: (tokens of {NEW} equal to tp=1, max logits rel err up to the first '
          'difference) per prompt: ' + ', '.join(f'({s}, {e:.2e})' for s, e in rows))
    for same, err in rows:
        assert same == NEW or err < 1e-2, rows


def quantized_bounds(exact, quantized):
    """Per prompt, the logits' error allowed where tp=N's tokens part from tp=1's: 1e-2, or with a quantized
    cache the error that cache makes by itself at tp=1 (its logits against the 16-bit cache's, up to where
    their tokens part), if larger. The ranks' other summation order moves K and V by bf16 rounding, and an
    int4 cache turns such moves into whole quantization steps: on Llama-3-8B's 5-token prompt int4 tp=4 parted
    from tp=1 at token 8 with 2.5e-2 apart, where the 16-bit and int8 caches stayed under 8.1e-3. tp is to
    cost no more than the quantization does."""
    if exact is quantized:
        return [1e-2] * len(exact)
    return [max(1e-2, err) for _, err in compare(exact, quantized)]
