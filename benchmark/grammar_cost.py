"""What a grammar (structured output) costs the host each step: filling the bitmask of N constrained
requests, and applying it to the logits on the device.

    python benchmark/grammar_cost.py                       # SmolLM2's tokenizer, cpu, 64 and 256 requests
    python benchmark/grammar_cost.py --model /tmp/l8b --device cuda

Each request's matcher is first advanced into a JSON string (the state a long constrained answer spends
most of its tokens in) by a few tokens of its own; then the fill is timed over ``--reps`` steps.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

SCHEMA = {'type': 'object', 'properties': {'text': {'type': 'string'}}, 'required': ['text']}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default=None, help='model directory (default: the embedded SmolLM2-135M)')
    p.add_argument('--device', default='cpu')
    p.add_argument('--batch', type=int, nargs='+', default=[64, 256])
    p.add_argument('--reps', type=int, default=20)
    args = p.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    from lmdeploy.default_model import resolve_model_path
    from lmdeploy.devices import get_device
    from lmdeploy.engine.grammar import Grammars, GrammarSpec
    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    grammars = Grammars(tok, vocab)
    spec = GrammarSpec('json_schema', json.dumps(SCHEMA))
    t = time.perf_counter()
    grammars.compile(spec)
    compile_ms = 1e3 * (time.perf_counter() - t)
    ops = get_device(args.device)
    dev = ops.torch_device()
    prefix = tok.encode('{"text": "', add_special_tokens=False)
    words = tok.encode(' the quick brown fox jumps over the lazy dog', add_special_tokens=False)
    print(f'vocab {vocab}, schema compiled in {compile_ms:.1f} ms (then cached)')
    print('| constrained requests | bitmask fill, host (ms / step) | apply on ' + args.device + ' (ms / step) |')
    print('| --- | --- | --- |')
    for n in args.batch:
        matchers = [grammars.matcher(spec) for _ in range(n)]
        for i, m in enumerate(matchers):
            for t in prefix + words[:1 + i % len(words)]:
                assert m.accept_token(t), t
        fill = []
        for _ in range(args.reps):
            t = time.perf_counter()
            mask = grammars.bitmask(matchers)
            fill.append(time.perf_counter() - t)
        logits = torch.randn(n, vocab, device=dev)
        mask = mask.to(dev)
        ops.apply_token_bitmask(logits, mask)
        get_device(args.device).synchronize()
        t = time.perf_counter()
        for _ in range(args.reps):
            ops.apply_token_bitmask(logits, mask)
        get_device(args.device).synchronize()
        apply = (time.perf_counter() - t) / args.reps
        fill.sort()
        print(f'| {n} | {1e3 * fill[len(fill) // 2]:.2f} | {1e3 * apply:.3f} |')


if __name__ == '__main__':
    main()
