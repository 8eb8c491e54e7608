"""The engine's host work per step, with the model taken out.

Every step the host schedules, packs the inputs, launches the model, then
does the bookkeeping of the step before (tokens in place, stop checks,
outputs). On a GPU that work overlaps the device's, and a step is as long as
the longer of the two: a small model's decode step can be shorter than the
host's. This runs the throughput workload's request mix through the real
engine on the cpu device with the model's forward and logits replaced by
empty tensors, so what is timed is the host alone.

    python benchmark/host_overhead.py --num-requests 2000 --max-batch-size 256
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench_utils import run_requests, stub_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--model', default=None, help='HF model dir, only its config is used (default: embedded model)')
    p.add_argument('--num-requests', type=int, default=2000)
    p.add_argument('--input-len', type=int, default=150)
    p.add_argument('--output-len', type=int, default=140)
    p.add_argument('--sigma', type=float, default=0.9)
    p.add_argument('--max-batch-size', type=int, default=256)
    p.add_argument('--eager-scheduling', action='store_true',
                   help='schedule as an eager device does (prefill in every step), not as a graph device')
    p.add_argument('--stream', action='store_true', help='an output per token (as streaming requests get)')
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args()

    from lmdeploy.default_model import default_model_path
    from lmdeploy.engine.engine import Engine
    from lmdeploy.messages import PytorchEngineConfig
    eng = Engine(args.model or default_model_path(),
                 PytorchEngineConfig(device_type='cpu', max_batch_size=args.max_batch_size, session_len=4096,
                                     max_prefill_token_num=8192, cache_max_entry_count=0.3))
    eng.scheduler.mix = args.eager_scheduling
    vocab = eng.model_config.vocab_size
    # a few columns of logits: on the cpu device sampling would otherwise run a real argmax over the
    # vocabulary (a launch on a GPU, milliseconds here)
    stub_model(eng, args.max_batch_size)

    times = {'prefill': [], 'decode': []}
    run_step = eng._run_step

    def timed(batch):
        t = time.perf_counter()
        run_step(batch)
        times['decode' if batch.is_decode else 'prefill'].append(time.perf_counter() - t)

    eng._run_step = timed
    rng = np.random.default_rng(args.seed)
    ins = np.clip(rng.lognormal(np.log(args.input_len), args.sigma, args.num_requests), 4, 2000).astype(int)
    outs = np.clip(rng.lognormal(np.log(args.output_len), args.sigma, args.num_requests), 4, 1000).astype(int)
    prompts = [None] * args.num_requests
    for i in np.argsort(-outs):  # drawn in this order since the first version: the same prompts
        prompts[i] = rng.integers(10, vocab, ins[i]).tolist()

    t0 = time.perf_counter()
    run_requests(eng, prompts, outs.tolist(), stream=args.stream)
    elapsed = time.perf_counter() - t0
    eng.close()
    x = eng.stats().extra
    for phase in ('prefill', 'decode'):
        t = times[phase]
        if t:
            print(f'{phase}: {len(t)} steps, {x[f"{phase}_seqs"] / len(t):.0f} seqs/step, host ms/step median '
                  f'{1e3 * statistics.median(t):.2f}, mean {1e3 * statistics.fmean(t):.2f}')
    print(f'{args.num_requests} requests, {sum(outs)} tokens in {elapsed:.1f} s of host work')


if __name__ == '__main__':
    main()
