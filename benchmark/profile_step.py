"""Where a step's time goes: host scheduling and input packing, the forward
(graph replay or eager), logits, sampling and bookkeeping.

    python benchmark/profile_step.py --model DIR --batch 256 --context 300 --steps 50

Synchronises the device around each phase and prints the mean milliseconds
of each: the engine normally overlaps the host phases with the device's
work (a step is launched before the previous one's tokens are read back),
so this shows what there is to hide, not the step time the engine achieves.
"""
from __future__ import annotations

import argparse
import math
import random
import time
from collections import defaultdict


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--model', required=True)
    p.add_argument('--device', default='cuda')
    p.add_argument('--batch', type=int, default=256)
    p.add_argument('--context', type=int, default=300)
    p.add_argument('--context-sigma', type=float, default=0.0,
                   help='lognormal sigma of the prompt lengths around --context (0: all equal)')
    p.add_argument('--steps', type=int, default=50)
    p.add_argument('--eager', action='store_true')
    p.add_argument('--kernels', action='store_true', help='also print the top GPU kernels of the decode steps')
    args = p.parse_args()

    import lmdeploy.engine.engine as engine_mod
    from lmdeploy.engine.engine import Engine, EngineRequest
    from lmdeploy.engine.sequence import SamplingParams
    from lmdeploy.messages import PytorchEngineConfig
    eng = Engine(args.model, PytorchEngineConfig(device_type=args.device, max_batch_size=args.batch,
                                                 eager_mode=args.eager, max_prefill_token_num=8192))
    sync = eng.device.synchronize
    times = defaultdict(float)
    counts = defaultdict(int)

    phase = ['prefill']

    def timed(name, fn):
        def wrapper(*a, **k):
            if name == 'step':
                phase[0] = 'decode' if a[0].is_decode else 'prefill'
            sync()
            t = time.perf_counter()
            out = fn(*a, **k)
            sync()
            key = f'{phase[0]}:{name}'
            times[key] += time.perf_counter() - t
            counts[key] += 1
            return out
        return wrapper

    runner = eng.runner
    runner.build_inputs = timed('build_inputs', runner.build_inputs)
    runner._eager_forward = timed('forward', runner._eager_forward)
    if runner.graphs is not None:  # replayed steps
        runner.graphs._decode = timed('forward', runner.graphs._decode)
        runner.graphs._mixed = timed('forward', runner.graphs._mixed)
    runner.logits = timed('logits', runner.logits)
    runner.greedy = timed('logits', runner.greedy)  # a greedy batch's logits and pick
    engine_mod.sample_tokens = timed('sample', engine_mod.sample_tokens)
    eng._step = timed('step', eng._step)
    eng.scheduler.schedule = timed('schedule', eng.scheduler.schedule)
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    n_steps = args.steps
    for i in range(args.batch):
        n = args.context if args.context_sigma <= 0 else \
            min(2000, max(4, round(rng.lognormvariate(math.log(args.context), args.context_sigma))))
        ids = [rng.randrange(100, vocab) for _ in range(n)]
        eng.submit(EngineRequest(i + 1, ids, SamplingParams(max_new_tokens=n_steps + 20), lambda o: None))
    prof = None
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile
        while eng.stats().num_waiting or eng.stats().extra.get('decode_steps', 0) < 5:
            time.sleep(0.05)  # past the prefill, into decoding
        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
        time.sleep(1.0)
        prof.__exit__(None, None, None)
    time.sleep(0.5)
    eng.wait_idle(600)
    if prof is not None:
        print(prof.key_averages().table(sort_by='cuda_time_total', row_limit=15, max_name_column_width=60))
    for k in sorted(times):
        print(f'{k:14s} {1e3 * times[k] / max(1, counts[k]):8.3f} ms  x{counts[k]}')
    eng.close()


if __name__ == '__main__':
    main()
