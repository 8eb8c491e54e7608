"""What KV-cache quantization (quant_policy 8 / 4) costs in quality, on a real model and a real text.

    python benchmark/kv_quant_quality.py                       # SmolLM2-135M, cpu, float32
    python benchmark/kv_quant_quality.py --model DIR --device cuda --dtype bfloat16

Perplexity over the text of ``pydoc_data.topics`` (Python's own reference
topics, which ship with every Python), scored in windows of ``--window``
tokens through the engine's ``get_ppl`` (every window prefilled through the
quantized cache), for each policy; and the share of greedy tokens that agree
with policy 0 over ``--prompts`` prompts (windows of the same text) of
``--new-tokens`` new tokens each (counted up to each sequence's first
disagreement, then the rest as disagreeing).
"""
from __future__ import annotations

import argparse
import math
from typing import Dict, List


def text_tokens(tokenizer, num_tokens: int) -> List[int]:
    import pydoc_data.topics as topics
    text = '\n\n'.join(topics.topics[k] for k in sorted(topics.topics))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f'the text has {len(ids)} tokens, fewer than {num_tokens}')
    return ids[:num_tokens]


def perplexity(pipe, ids: List[int], window: int) -> float:
    """exp of the mean cross-entropy of every token after the first of each window."""
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    losses = pipe.get_ppl(windows)
    total = sum(loss * (len(w) - 1) for loss, w in zip(losses, windows))
    return math.exp(total / sum(len(w) - 1 for w in windows))


def greedy(pipe, prompts: List[List[int]], new_tokens: int) -> List[List[int]]:
    from lmdeploy import GenerationConfig
    gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    return [r.token_ids for r in pipe(prompts, [gen] * len(prompts))]


def agreement(ref: List[List[int]], got: List[List[int]]) -> float:
    """Share of tokens equal to the reference's, up to each sequence's first disagreement."""
    same = 0
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += n
    return same / sum(len(a) for a in ref)


def measure(model: str, device: str, dtype: str, policies, num_tokens: int, window: int, num_prompts: int,
            prompt_len: int, new_tokens: int) -> Dict[int, dict]:
    from lmdeploy import PytorchEngineConfig, pipeline
    results: Dict[int, dict] = {}
    ref_tokens = None
    for policy in policies:
        pipe = pipeline(model, backend_config=PytorchEngineConfig(
            device_type=device, dtype=dtype, quant_policy=policy, session_len=max(window, prompt_len + new_tokens) + 8,
            max_prefill_token_num=max(window, 256)))
        try:
            ids = text_tokens(pipe.tokenizer, num_tokens)
            row = dict(tokens=len(ids), ppl=perplexity(pipe, ids, window),
                       kv_tokens=pipe.engine.num_blocks * pipe.engine.block_size)
            if num_prompts:
                prompts = [ids[i * prompt_len:(i + 1) * prompt_len] for i in range(num_prompts)]
                out = greedy(pipe, prompts, new_tokens)
                ref_tokens = ref_tokens or out
                row['agreement'] = agreement(ref_tokens, out)
        finally:
            pipe.close()
        results[policy] = row
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default=None, help='model directory (default: the embedded SmolLM2-135M)')
    p.add_argument('--device', default='cpu')
    p.add_argument('--dtype', default='float32')
    p.add_argument('--policies', type=int, nargs='+', default=[0, 8, 4])
    p.add_argument('--tokens', type=int, default=20480, help='tokens of the text scored')
    p.add_argument('--window', type=int, default=2048)
    p.add_argument('--prompts', type=int, default=32)
    p.add_argument('--prompt-len', type=int, default=128)
    p.add_argument('--new-tokens', type=int, default=64)
    args = p.parse_args()
    from lmdeploy.default_model import resolve_model_path
    results = measure(resolve_model_path(args.model), args.device, args.dtype, args.policies, args.tokens,
                      args.window, args.prompts, args.prompt_len, args.new_tokens)
    base = results.get(0, {}).get('ppl')
    print(f'| quant_policy | perplexity ({results[args.policies[0]]["tokens"]} tokens, windows of {args.window}) '
          f'| vs policy 0 | greedy tokens agreeing with policy 0 | KV capacity (tokens) |')
    print('| --- | --- | --- | --- | --- |')
    for policy, row in results.items():
        rel = f'{100 * (row["ppl"] / base - 1):+.2f} %' if base else '-'
        agree = f'{100 * row["agreement"]:.1f} %' if 'agreement' in row else '-'
        print(f'| {policy} | {row["ppl"]:.4f} | {rel} | {agree} | {row["kv_tokens"]:,} |')


if __name__ == '__main__':
    main()
