"""Host and device time of a step that carries new prompt tokens beside decoding sequences.

    python benchmark/mixed_step.py --model /tmp/l8b --mix 64:150 128:150 64:500 200:1000

Each ``D:P`` is a step of D one-token rows (context ``--context``) plus one
prompt chunk of P tokens. The step runs through the engine's model runner
as the engine runs it: dense parts replayed in pieces with attention live
between them (``pieces``), or every kernel launched from Python
(``eager``); a decode-only step of D rows (a whole replayed graph) is the
reference. ``host`` is the time the call takes to return (the launches:
the device is idle when it starts), ``step`` the time until the device has
finished it. The engine launches step N+1 while the device runs step N, so
a step's host time must stay under the device time of the step before it.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', required=True)
    p.add_argument('--device', default='cuda')
    p.add_argument('--mix', nargs='+', default=['16:150', '64:150', '128:150', '64:500', '200:1000'])
    p.add_argument('--context', type=int, default=300)
    p.add_argument('--iters', type=int, default=20)
    args = p.parse_args()

    import torch

    from lmdeploy.engine.engine import Engine
    from lmdeploy.engine.scheduler import ScheduledBatch
    from lmdeploy.engine.sequence import SamplingParams, Sequence
    from lmdeploy.messages import PytorchEngineConfig
    eng = Engine(args.model, PytorchEngineConfig(device_type=args.device, max_batch_size=256,
                                                 max_prefill_token_num=4096))
    runner, bm, sync = eng.runner, eng.block_manager, eng.device.synchronize
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    params = SamplingParams()

    def sequence(i, context, new):
        s = Sequence(i, i, [rng.randrange(100, vocab) for _ in range(context + new)], params, None, 1 << 20)
        s.num_computed = context
        s.block_ids = bm.allocate(bm.blocks_for(context + new))
        return s

    def timed(batch, n):
        host, total = [], []
        for i in range(n + 3):
            sync()
            t0 = time.perf_counter()
            with torch.inference_mode():
                runner.forward(batch)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            if i >= 3:
                host.append(1e3 * (t1 - t0))
                total.append(1e3 * (t2 - t0))
        return statistics.median(host), statistics.median(total)

    pieces = runner.pieces
    print(f'{"step":>12s} {"mode":>7s} {"host ms":>8s} {"step ms":>8s}')
    for mix in args.mix:
        d, n_prompt = (int(x) for x in mix.split(':'))
        decode = [sequence(i, args.context, 1) for i in range(d)]
        prompt = sequence(d, 0, n_prompt)
        mixed = ScheduledBatch(decode + [prompt], [1] * d + [n_prompt])
        rows = [('decode', ScheduledBatch(decode, [1] * d), pieces)]
        if pieces is not None and pieces.fits(d + n_prompt):
            rows.append(('pieces', mixed, pieces))
        rows.append(('eager', mixed, None))
        for mode, batch, use in rows:
            runner.pieces = use
            host, total = timed(batch, args.iters)
            label = f'{d}+{n_prompt}' if mode != 'decode' else f'{d}'
            print(f'{label:>12s} {mode:>7s} {host:8.2f} {total:8.2f}', flush=True)
        runner.pieces = pieces
        for s in decode + [prompt]:
            bm.free(s.block_ids)
    eng.close()


if __name__ == '__main__':
    main()
