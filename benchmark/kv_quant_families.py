"""What the quantized KV caches (quant_policy 8 / 4) cost each model family, on the tests' tiny random models.

    python benchmark/kv_quant_families.py            # cpu, float32; --families gemma2 phi3 ... to pick

Every family the engine loads, built as its tests build it (tests/helpers.py: transformers configs with a
window shorter than the text, soft caps, partial or interleaved rotary, LayerNorms, ALiBi where the family
has them; random weights with sharp logits). A random model gives any real text a meaningless perplexity (its
confident guesses are wrong), so each model scores text it wrote itself: ``--samples`` sequences of
``--window`` tokens sampled at temperature 1 (no top-k / top-p) with the unquantized cache from short random
prompts, then scored by ``get_ppl`` with each policy. The perplexity under policy 0 is then about exp of the
model's entropy, and the relative change under policy q about the KL divergence the cache's rounding adds
(in nats, for small changes): how far it moves each family's predictions. Imports the tests' model builders
(run from the repository).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'tests'))

import helpers  # noqa: E402 (the tests' builders)

BASE = dict(vocab_size=helpers.TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2, rope_theta=10000.0)
WINDOW = 48  # the sliding families' window: shorter than the scored windows


def _custom(cls_name, **kw):
    return lambda out, tok: helpers.build_tiny_custom(out, tok, cls_name, dict(helpers._COMMON, **kw), seed=7)


FAMILIES = {
    'llama': _custom('LlamaConfig', tie_word_embeddings=False),
    'mistral (window)': _custom('MistralConfig', sliding_window=WINDOW, tie_word_embeddings=False),
    'qwen2 (window on layer 1)': _custom('Qwen2Config', use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=1, tie_word_embeddings=False),
    'qwen3': _custom('Qwen3Config', attention_bias=False, tie_word_embeddings=False),
    'internlm2': lambda out, tok: helpers.llama_to_internlm2(_custom('LlamaConfig', tie_word_embeddings=False)(
        out + '.src', tok), out),
    'internlm3': lambda out, tok: helpers.to_internlm3(_custom('LlamaConfig', tie_word_embeddings=False)(
        out + '.src', tok), out),
    'phi3 (longrope)': lambda out, tok: helpers.build_tiny_custom(
        out, tok, 'Phi3Config', dict(helpers.tiny_phi3_kwargs(longrope=True, original=256), tie_word_embeddings=False),
        seed=7),
    'gemma': lambda out, tok: helpers.build_tiny_gemma(out, tok, seed=7),
    'gemma2 (window, soft caps)': lambda out, tok: helpers.build_tiny_gemma2(out, tok, seed=7,
                                                                            sliding_window=WINDOW),
    'gemma3 (window)': lambda out, tok: helpers.build_tiny_gemma3(out, tok, seed=7),
    'glm4 (partial rotary)': _custom('Glm4Config', attention_bias=True, partial_rotary_factor=0.5,
                                     rope_scaling=dict(partial_rotary_factor=0.5), tie_word_embeddings=False),
    'starcoder2 (window)': lambda out, tok: helpers.build_tiny_starcoder2(
        out, tok, dict(BASE, intermediate_size=128, num_key_value_heads=2, norm_epsilon=1e-5, use_bias=True,
                       hidden_act='gelu_pytorch_tanh', tie_word_embeddings=True, sliding_window=WINDOW), seed=7),
    'falcon (grouped)': lambda out, tok: helpers.build_tiny_falcon(
        out, tok, dict(BASE, ffn_hidden_size=128, layer_norm_epsilon=1e-5, alibi=False,
                       new_decoder_architecture=True, num_kv_heads=2, bias=True), seed=7),
    'falcon-rw (alibi)': lambda out, tok: helpers.build_tiny_falcon(
        out, tok, dict(BASE, ffn_hidden_size=128, layer_norm_epsilon=1e-5, alibi=True,
                       new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True), seed=7),
}


def _pipe(path: str, policy: int, window: int):
    from lmdeploy import PytorchEngineConfig, pipeline
    return pipeline(path, backend_config=PytorchEngineConfig(device_type='cpu', dtype='float32', quant_policy=policy,
                                                             session_len=window + 8, max_prefill_token_num=window))


def own_text(path: str, samples: int, window: int, seed: int = 0):
    """``samples`` sequences of ``window`` tokens the model samples itself (policy 0, temperature 1)."""
    import random

    from lmdeploy import GenerationConfig
    rng = random.Random(seed)
    prompts = [[rng.randrange(20, helpers.TINY_VOCAB) for _ in range(4)] for _ in range(samples)]
    gens = [GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, ignore_eos=True,
                             max_new_tokens=window - 4, random_seed=seed + i) for i in range(samples)]
    with _pipe(path, 0, window) as pipe:
        return [p + r.token_ids for p, r in zip(prompts, pipe(prompts, gens))]


def perplexity(path: str, policy: int, seqs, window: int) -> float:
    with _pipe(path, policy, window) as pipe:
        losses = pipe.get_ppl(seqs)
    n = sum(len(s) - 1 for s in seqs)
    return math.exp(sum(loss * (len(s) - 1) for loss, s in zip(losses, seqs)) / n)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--families', nargs='+', default=list(FAMILIES), metavar='NAME')
    p.add_argument('--policies', type=int, nargs='+', default=[8, 4])
    p.add_argument('--samples', type=int, default=8)
    p.add_argument('--window', type=int, default=256)
    args = p.parse_args()
    from lmdeploy.default_model import default_model_path
    tok = default_model_path()
    print(f'| family | perplexity of its own text, policy 0 ({args.samples} x {args.window} tokens) | '
          + ' | '.join(f'policy {q}' for q in args.policies) + ' |')
    print('| --- | --- |' + ' --- |' * len(args.policies))
    with tempfile.TemporaryDirectory() as root:
        for name in args.families:
            key = next(k for k in FAMILIES if k == name or k.split(' ')[0] == name)
            path = FAMILIES[key](os.path.join(root, key.split(' ')[0]), tok)
            seqs = own_text(path, args.samples, args.window)
            base = perplexity(path, 0, seqs, args.window)
            cells = []
            for q in args.policies:
                try:
                    cells.append(f'{100 * (perplexity(path, q, seqs, args.window) / base - 1):+.3f} %')
                except ValueError as e:  # a policy the family's head size cannot take
                    cells.append(f'refused ({e})'[:80])
            print(f'| {key} | {base:,.1f} | ' + ' | '.join(cells) + ' |', flush=True)


if __name__ == '__main__':
    main()
