"""Where the GPU waits: reads a trace written by ``throughput.py --trace``.

Splits the window into steps (each begins with the step's one host-to-device
copy of its inputs), labels each prefill (it runs the prefill attention
kernel) or decode, and prints per kind: wall time a step, kernel time, idle
time, and which kernel boundaries the idle time sits at (the kernel before
and after the gap), largest first.

    python benchmark/trace_gaps.py trace.json.gz [--top 12]
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


def short(name: str) -> str:
    low = name.lower()
    if any(w in low for w in ('gemm', 'nvjet', 'cutlass', 'xmma', 'splitk', 'sm90_')):
        return 'GEMM'
    if 'memcpy' in low:
        return name.split('(')[0].strip()
    return name[:40]


def load(path: str):
    opener = gzip.open if path.endswith('.gz') else open
    with opener(path, 'rt') as f:
        trace = json.load(f)
    events = [e for e in trace['traceEvents'] if e.get('ph') == 'X' and e.get('cat') in ('kernel', 'gpu_memcpy',
                                                                                        'gpu_memset')]
    return sorted(((float(e['ts']), float(e['dur']), e['name']) for e in events), key=lambda e: e[0])


def steps(events):
    """Lists of events, one a step, cut at each host-to-device copy."""
    out, cur = [], []
    for e in events:
        if 'HtoD' in e[2] and cur:
            out.append(cur)
            cur = []
        cur.append(e)
    if cur:
        out.append(cur)
    return out[1:-1]  # the first and last are cut by the window


def main():
    p = argparse.ArgumentParser()
    p.add_argument('trace')
    p.add_argument('--top', type=int, default=12)
    args = p.parse_args()
    events = load(args.trace)
    span = events[-1][0] + events[-1][1] - events[0][0]
    print(f'{len(events)} device events over {span / 1e3:.1f} ms')
    kinds = defaultdict(lambda: dict(n=0, wall=0.0, busy=0.0, kernels=0, by_kernel=defaultdict(float),
                                     gaps=defaultdict(lambda: [0.0, 0])))
    all_steps = steps(events)
    for i, step in enumerate(all_steps):
        kind = 'prefill' if any('prefill' in e[2] for e in step) else 'decode'
        k = kinds[kind]
        nxt = all_steps[i + 1][0][0] if i + 1 < len(all_steps) else step[-1][0] + step[-1][1]
        k['n'] += 1
        k['wall'] += nxt - step[0][0]
        end, prev = step[0][0], 'step start'
        for ts, dur, name in step:
            if ts > end:
                g = k['gaps'][(prev, short(name))]
                g[0] += ts - end
                g[1] += 1
            k['busy'] += max(0.0, ts + dur - max(ts, end))
            k['by_kernel'][short(name)] += dur
            k['kernels'] += 1
            end, prev = max(end, ts + dur), short(name)
        if nxt > end:
            g = k['gaps'][(prev, 'next step')]
            g[0] += nxt - end
            g[1] += 1
    for kind, k in kinds.items():
        n = k['n']
        print(f"\n{kind}: {n} steps, {k['wall'] / n / 1e3:.2f} ms a step, kernels busy {k['busy'] / n / 1e3:.2f} ms, "
              f"idle {(k['wall'] - k['busy']) / n / 1e3:.3f} ms, {k['kernels'] / n:.0f} events a step")
        print('  time a step by kernel:')
        for name, t in sorted(k['by_kernel'].items(), key=lambda kv: -kv[1])[:args.top]:
            print(f'    {t / n / 1e3:8.3f} ms  {name}')
        print('  idle a step, by the kernels around the gap:')
        for (a, b), (t, c) in sorted(k['gaps'].items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f'    {t / n:9.1f} us  ({c / n:5.1f} gaps)  {a} -> {b}')


if __name__ == '__main__':
    main()
