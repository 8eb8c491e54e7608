"""Where the GPU waits: reads a trace written by ``throughput.py --trace``.

Splits the window into steps (each begins with the step's one host-to-device
copy of its inputs), labels each prefill (it runs the prefill attention
kernel) or decode, and prints per kind: wall time a step, kernel time, idle
time, and which kernel boundaries the idle time sits at (the kernel before
and after the gap), largest first. A trace written with ``--trace-host``
also says what the host was doing during the gaps: the engine loop's phase
and the host op under way at each gap's middle.

    python benchmark/trace_gaps.py trace.json.gz [--top 12]
"""
from __future__ import annotations

import argparse
import bisect
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


def load_host(path: str):
    """The engine loop thread's phases (``engine.*`` ranges) and that thread's host ops, each a sorted list
    of (start, end, name); empty where the trace has no host side."""
    opener = gzip.open if path.endswith('.gz') else open
    with opener(path, 'rt') as f:
        trace = json.load(f)
    xs = [e for e in trace['traceEvents'] if e.get('ph') == 'X' and 'dur' in e]
    phases = [e for e in xs if e.get('cat') == 'user_annotation' and e['name'].startswith('engine.')]
    if not phases:
        return [], []
    tid = max({e['tid'] for e in phases}, key=lambda t: sum(1 for e in phases if e['tid'] == t))
    ops = [e for e in xs if e.get('tid') == tid and e.get('cat') in ('cpu_op', 'cuda_runtime', 'cuda_driver')]

    def spans(es):
        return sorted((float(e['ts']), float(e['ts']) + float(e['dur']), e['name']) for e in es)
    return spans(e for e in phases if e['tid'] == tid), spans(ops)


def innermost(spans, t: float, look_back: int = 500) -> str:
    """The shortest of the spans (sorted, nesting) that holds ``t``, among the ``look_back`` that start last
    before it; or 'outside'."""
    best = None
    i = bisect.bisect_right(spans, (t, float('inf'), ''))
    for s, e, name in spans[max(0, i - look_back):i]:
        if e >= t and (best is None or e - s < best[1] - best[0]):
            best = (s, e, name)
    return best[2] if best else 'outside'


def idle_by_host(events, phases, ops, min_gap: float = 20.0):
    """Idle device time in gaps over ``min_gap`` us, by the host's phase and by (phase, op) at the gap's middle."""
    by_phase, by_op = defaultdict(float), defaultdict(float)
    end = events[0][0] + events[0][1]
    for ts, dur, _ in events[1:]:
        if ts - end > min_gap:
            mid = (ts + end) / 2
            phase = innermost(phases, mid)
            by_phase[phase] += ts - end
            by_op[(phase, innermost(ops, mid))] += ts - end
        end = max(end, ts + dur)
    return by_phase, by_op


def host_during_gaps(events, path: str, top: int):
    """What the host did while the device idled (a trace with the host side)."""
    phases, ops = load_host(path)
    if not phases:
        return
    by_phase, by_op = idle_by_host(events, phases, ops)
    total = sum(by_phase.values())
    print(f'\nidle in gaps over 20 us: {total / 1e3:.1f} ms; the engine loop was in')
    for name, t in sorted(by_phase.items(), key=lambda kv: -kv[1]):
        print(f'    {t / 1e3:8.2f} ms  {name}')
    print('  by phase and host op:')
    for (phase, op), t in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f'    {t / 1e3:8.2f} ms  {phase}: {op[:60]}')


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
    host_during_gaps(events, args.trace, args.top)


if __name__ == '__main__':
    main()
