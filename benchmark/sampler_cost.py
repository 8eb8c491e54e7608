"""What sampling costs per decode step when some rows need more than an argmax.

    python benchmark/sampler_cost.py --device cuda --batch 250 --vocab 128256 --fractions 0 0.17 0.33 0.67

For each fraction of processed rows (in turn: OpenAI penalties over 150 generated ids, a logit_bias of 8
ids, a seeded draw with top_p), the host time to queue ``sample_tokens`` and the device time from its
first kernel to its last (CUDA events), averaged over repeats after a warm-up. Plain greedy rows are an
argmax of the model-dtype logits; the rest go through the sampler's float32 copy.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from lmdeploy.devices import get_device
from lmdeploy.engine.sampler import sample_tokens
from lmdeploy.engine.sequence import SamplingParams, Sequence


def batch(n: int, fraction: float, vocab: int, rng: random.Random):
    kinds = [dict(frequency_penalty=0.5, presence_penalty=0.3), 'bias', dict(greedy=False, temperature=0.8, top_p=0.9, seed=1)]
    seqs, every = [], round(1 / fraction) if fraction else 0
    for i in range(n):
        kw = {}
        if every and i % every == 0:
            kind = kinds[(i // every) % len(kinds)]
            kw = dict(logit_bias={rng.randrange(vocab): rng.uniform(-3, 3) for _ in range(8)}) if kind == 'bias' \
                else kind
        seq = Sequence(i, i, [rng.randrange(vocab) for _ in range(150)], SamplingParams(max_new_tokens=1000, **kw),
                       lambda out: None, max_len=4096)
        seq.token_ids += [rng.randrange(vocab) for _ in range(150)]  # generated so far
        seq.num_generated = 150
        seqs.append(seq)
    return seqs


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--device', default='cuda')
    p.add_argument('--batch', type=int, default=250)
    p.add_argument('--vocab', type=int, default=128256)
    p.add_argument('--fractions', type=float, nargs='+', default=[0.0, 0.17, 0.33, 0.67])
    p.add_argument('--repeats', type=int, default=50)
    args = p.parse_args()
    ops, rng = get_device(args.device), random.Random(0)
    dev = ops.torch_device()
    dtype = torch.bfloat16 if dev.type == 'cuda' else torch.float32  # the model dtype of a GPU run
    logits = torch.randn(args.batch, args.vocab, device=dev).to(dtype)
    timed = dev.type == 'cuda'
    for fraction in args.fractions:
        seqs = batch(args.batch, fraction, args.vocab, rng)
        processed = sum(not s.params.plain_greedy for s in seqs)
        for _ in range(3):
            sample_tokens(logits, seqs, ops)
        ops.synchronize()
        host = device = 0.0
        for _ in range(args.repeats):
            if timed:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            sample_tokens(logits, seqs, ops)
            host += time.perf_counter() - t0
            if timed:
                end.record()
                end.synchronize()
                device += start.elapsed_time(end) / 1e3
            else:
                device += time.perf_counter() - t0
        print(f'{processed:4d} of {args.batch} rows processed: host {1e3 * host / args.repeats:6.3f} ms to queue, '
              f'device {1e3 * device / args.repeats:6.3f} ms', flush=True)


if __name__ == '__main__':
    main()
