"""vLLM on the same offline workloads as throughput.py and latency.py (the peer of ../shared/peers), in one
process: the lognormal request workload (throughput.py's generator and seed, so the same prompts and lengths)
and batch-1 latency (one prompt of --input-len random ids, --output-len tokens, the median of --runs after a
warm-up).

    PYTHONPATH=/tmp/vsite python benchmark/vllm_offline.py --model DIR --tp 2 --num-requests 2000 \
        --input-len 150 --output-len 140 --input-sigma 0.9 --output-sigma 0.9
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from throughput import make_workload


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--model', required=True)
    p.add_argument('--tp', type=int, default=1)
    p.add_argument('--num-requests', type=int, default=2000)
    p.add_argument('--input-len', type=int, default=150)
    p.add_argument('--output-len', type=int, default=140)
    p.add_argument('--input-sigma', type=float, default=0.9)
    p.add_argument('--output-sigma', type=float, default=0.9)
    p.add_argument('--max-input-len', type=int, default=2000)
    p.add_argument('--max-output-len', type=int, default=1000)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--latency-input-len', type=int, default=512)
    p.add_argument('--latency-output-len', type=int, default=256)
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--trust-remote-code', action='store_true',
                   help="read the model's config through its own module (family_model.py's InternLM2 layout)")
    args = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype='bfloat16', max_model_len=4096, max_num_seqs=256, gpu_memory_utilization=0.9,
              tensor_parallel_size=args.tp, seed=0, trust_remote_code=args.trust_remote_code)
    print(f'[vllm tp={args.tp}] loaded in {time.perf_counter() - t0:.1f} s', flush=True)
    with open(os.path.join(args.model, 'config.json')) as f:
        vocab = json.load(f)['vocab_size']

    def sp(n):
        return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)

    # batch 1
    rng = random.Random(0)
    times = []
    for r in range(args.runs + 1):
        ids = [rng.randrange(100, vocab) for _ in range(args.latency_input_len)]
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], sp(args.latency_output_len), use_tqdm=False)
        if r:
            times.append(time.perf_counter() - t)
    e2e = statistics.median(times)
    print(f'[vllm tp={args.tp} latency] input {args.latency_input_len}, output {args.latency_output_len}: '
          f'end-to-end {args.latency_output_len / e2e:.1f} tok/s ({e2e:.3f} s a request)', flush=True)

    prompts, outs = make_workload(args, vocab)
    reqs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    t = time.perf_counter()
    res = llm.generate(reqs, [sp(n) for n in outs], use_tqdm=False)
    elapsed = time.perf_counter() - t
    generated = sum(len(r.outputs[0].token_ids) for r in res)
    assert generated == sum(outs), (generated, sum(outs))
    print(f'[vllm tp={args.tp}] {len(reqs)} requests in {elapsed:.2f} s: {len(reqs) / elapsed:.2f} req/s, '
          f'input {sum(map(len, prompts)) / elapsed:.1f} tok/s, output {generated / elapsed:.1f} tok/s', flush=True)


if __name__ == '__main__':
    main()
