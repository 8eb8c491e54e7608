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
    p.add_argument('--kernels', action='store_true',
                   help="print where each mixed step's device time goes: its kernels (launched eagerly, so "
                        "each is timed alone) grouped by kind, and the GEMMs' achieved TFLOP/s")
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
        d, prompts = mix.split(':')
        d, prompt_lens = int(d), [int(x) for x in prompts.split(',')]
        n_prompt = sum(prompt_lens)
        decode = [sequence(i, args.context, 1) for i in range(d)]
        prompt_seqs = [sequence(d + j, 0, n) for j, n in enumerate(prompt_lens)]
        mixed = ScheduledBatch(decode + prompt_seqs, [1] * d + prompt_lens)
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
        if args.kernels:
            runner.graphs, runner.pieces = None, None
            kernel_table(lambda: runner.forward(mixed), sync, eng.model_config, d + n_prompt, total)
        runner.graphs, runner.pieces = graphs, None
        for s in decode + prompt_seqs:
            bm.free(s.block_ids)
    eng.close()


KINDS = (('gemm', ('gemm', 'nvjet', 'xmma', 'cutlass', 'cublas', 'sm90_', 'sm80_')),
         ('attention', ('attn', 'attention', 'flash', 'prefill_kernel', 'decode_kernel', 'decode_reduce')),
         ('norm', ('norm',)), ('rotary/kv fill', ('rot', 'fill', 'cache')),
         ('activation', ('silu', 'gelu', 'act')), ('sampling', ('sample', 'argmax', 'softmax')))


def kernel_table(step, sync, cfg, num_tokens, graph_ms):
    """One eager step under the torch profiler: device time by kernel kind and the top kernels; the
    block GEMMs' TFLOP/s counts 2 x tokens x (the layer's weights) per layer (the LM head apart)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode():
        step(), sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(), sync()
    per_kernel = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, t = per_kernel.get(e.name, (0, 0.0))
            per_kernel[e.name] = (n + 1, t + e.device_time_total / 1e3)
    total = sum(t for _, t in per_kernel.values())
    kinds = {}
    for name, (_, t) in per_kernel.items():
        low = name.lower()
        kind = next((k for k, keys in KINDS if any(key in low for key in keys)), 'other')
        kinds[kind] = kinds.get(kind, 0.0) + t
    from bench_utils import block_gemm_flops_per_token
    flops = num_tokens * block_gemm_flops_per_token(cfg)
    print(f'  kernels: {total:.2f} ms in all (the replayed step: {graph_ms:.2f} ms); block GEMMs '
          f'{flops / 1e12:.1f} TFLOP -> {flops / 1e9 / max(kinds.get("gemm", 1e-9), 1e-9):.0f} TFLOP/s '
          'over the gemm kernels (LM head included in their time)')
    for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f'    {kind:>15s} {t:8.2f} ms {100 * t / total:5.1f} %')
    for name, (n, t) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f'    {t:8.2f} ms {n:5d}x  {name[:110]}')


if __name__ == '__main__':
    main()
