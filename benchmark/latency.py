"""Single-request latency: time to first token and decode speed.

    python benchmark/latency.py --model DIR --input-len 512 --output-len 256 --device cuda

Sends random-token prompts one at a time through the pipeline's streaming
API, ignore_eos, and prints TTFT, time per output token (percentiles over
steps), decode tokens/s and end-to-end output tokens/s (prefill included).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def measure(pipe, input_len: int, output_len: int, runs: int = 3, seed: int = 0):
    """Stream ``runs`` requests of ``input_len`` random tokens one at a time through ``pipe`` (after one
    that warms up), ``output_len`` tokens each; returns the runs' medians and the runs."""
    from lmdeploy import GenerationConfig
    vocab = pipe.engine.model_config.vocab_size
    rng = random.Random(seed)
    gen = GenerationConfig(max_new_tokens=output_len, ignore_eos=True)
    timed = []
    for r in range(runs + 1):  # the first run warms up
        ids = [rng.randrange(100, vocab) for _ in range(input_len)]
        stamps = []
        t0 = time.perf_counter()
        for out in pipe.stream_infer(ids, gen):
            stamps.extend([time.perf_counter()] * max(1, len(out.token_ids)))
        if r == 0:
            continue
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        timed.append(dict(ttft_s=stamps[0] - t0, tpot_p50_ms=1e3 * percentile(gaps, 50),
                          tpot_p90_ms=1e3 * percentile(gaps, 90), tpot_p99_ms=1e3 * percentile(gaps, 99),
                          decode_tok_s=len(gaps) / (stamps[-1] - stamps[0]), e2e_tok_s=len(stamps) / (stamps[-1] - t0)))
    return {k: statistics.median(r[k] for r in timed) for k in timed[0]}, timed


def summary_line(device: str, input_len: int, output_len: int, summary: dict) -> str:
    return (f'[latency on {device}] input {input_len}, output {output_len}: '
            f"TTFT {summary['ttft_s'] * 1e3:.1f} ms, TPOT p50 {summary['tpot_p50_ms']:.2f} ms "
            f"p90 {summary['tpot_p90_ms']:.2f} ms p99 {summary['tpot_p99_ms']:.2f} ms, "
            f"decode {summary['decode_tok_s']:.1f} tok/s, end-to-end {summary['e2e_tok_s']:.1f} tok/s")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default=None)
    p.add_argument('--device', default='auto')
    p.add_argument('--dtype', default='auto')
    p.add_argument('--input-len', type=int, default=512)
    p.add_argument('--output-len', type=int, default=256)
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--eager', action='store_true')
    p.add_argument('--tp', type=int, default=1, help='tensor parallelism (GPUs)')
    p.add_argument('--quant-policy', type=int, default=0, choices=(0, 4, 8), help='KV cache int8 (8) / int4 (4)')
    p.add_argument('--json', default=None)
    args = p.parse_args()

    from lmdeploy import PytorchEngineConfig, pipeline
    pipe = pipeline(args.model, backend_config=PytorchEngineConfig(device_type=args.device, dtype=args.dtype,
                                                                   eager_mode=args.eager, max_batch_size=8,
                                                                   quant_policy=args.quant_policy, tp=args.tp))
    summary, runs = measure(pipe, args.input_len, args.output_len, args.runs)
    device = pipe.engine.device.name
    pipe.close()
    print(summary_line(device, args.input_len, args.output_len, summary))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(summary=summary, runs=runs), f, indent=2)


if __name__ == '__main__':
    main()
