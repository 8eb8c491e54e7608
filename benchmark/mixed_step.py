"""Host and device time of a step that carries new prompt tokens beside decoding sequences.

    python benchmark/mixed_step.py --model /tmp/l8b --mix 64:150 128:150 64:500 200:1000

Each ``D:P`` is a step of D one-token rows (context ``--context``) plus one
prompt chunk of P tokens. The step runs through the engine's model runner:
replayed whole from a recording of its padded token count (``graph``, what
the engine does), with its dense parts replayed in pieces and attention
live between them (``pieces``, with ``--pieces``: what a device that
records only those does), or every kernel launched from Python
(``eager``); a decode-only step of D rows (a replayed graph) is the
reference. ``host`` is the time the call takes to return (the launches:
the device is idle when it starts), ``step`` the time until the device has
finished it. The engine launches step N+1 while the device runs step N, so
a step's host time must stay under the device time of the step before it.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
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
    p.add_argument('--profile', action='store_true', help="print the host's Python profile of each mode's steps")
    p.add_argument('--pieces', action='store_true', help='also time steps replayed in pieces')
    args = p.parse_args()

    import torch

    from lmdeploy.engine.engine import Engine
    from lmdeploy.engine.scheduler import ScheduledBatch
    from lmdeploy.engine.sequence import SamplingParams, Sequence
    from lmdeploy.messages import PytorchEngineConfig
    eng = Engine(args.model, PytorchEngineConfig(device_type=args.device, max_batch_size=256,
                                                 max_prefill_token_num=4096,
                                                 warmup=False))  # it warms each path itself
    runner, bm, sync = eng.runner, eng.block_manager, eng.device.synchronize
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    params = SamplingParams()

    def sequence(i, context, new):
        s = Sequence(i, i, [rng.randrange(100, vocab) for _ in range(context + new)], params, None, 1 << 20)
        s.num_computed = context
        s.block_ids = bm.allocate(bm.blocks_for(context + new))
        return s

    def timed(batch, n, profiler=None):
        host, total = [], []
        for i in range(n + 3):
            sync()
            if profiler is not None and i == 3:
                profiler.enable()
            t0 = time.perf_counter()
            with torch.inference_mode():
                runner.forward(batch)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            if i >= 3:
                host.append(1e3 * (t1 - t0))
                total.append(1e3 * (t2 - t0))
        if profiler is not None:
            profiler.disable()
        return statistics.median(host), statistics.median(total)

    graphs = runner.graphs
    pieces = None
    if args.pieces:
        from lmdeploy.engine.piecewise import PiecewiseRunner
        t0 = time.perf_counter()
        with torch.inference_mode():
            pieces = PiecewiseRunner(eng.runtime, eng.model, runner.kv_caches,
                                     dataclasses.replace(eng.plan, max_mixed_tokens=2048))
            pieces.capture_all()
        print(f'pieces recorded in {time.perf_counter() - t0:.1f} s')
    print(f'{"step":>12s} {"mode":>7s} {"host ms":>8s} {"step ms":>8s}')
    for mix in args.mix:
        d, n_prompt = (int(x) for x in mix.split(':'))
        decode = [sequence(i, args.context, 1) for i in range(d)]
        prompt = sequence(d, 0, n_prompt)
        mixed = ScheduledBatch(decode + [prompt], [1] * d + [n_prompt])
        rows = [('decode', ScheduledBatch(decode, [1] * d), graphs, None), ('graph', mixed, graphs, None)]
        if pieces is not None and pieces.fits(d + n_prompt):
            rows.append(('pieces', mixed, None, pieces))
        rows.append(('eager', mixed, None, None))
        for mode, batch, use_graphs, use_pieces in rows:
            runner.graphs, runner.pieces = use_graphs, use_pieces
            prof = cProfile.Profile() if args.profile else None
            host, total = timed(batch, args.iters, prof)
            label = f'{d}+{n_prompt}' if mode != 'decode' else f'{d}'
            print(f'{label:>12s} {mode:>7s} {host:8.2f} {total:8.2f}', flush=True)
            if prof is not None:
                pstats.Stats(prof).sort_stats('tottime').print_stats(18)
        runner.graphs, runner.pieces = graphs, None
        for s in decode + [prompt]:
            bm.free(s.block_ids)
    eng.close()


if __name__ == '__main__':
    main()
