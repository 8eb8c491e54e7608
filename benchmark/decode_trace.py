"""Where a compiled decode-attention call spends its time, block by block.

Build the extension with the kernel's timestamps first (never in a normal build):

    LMDEPLOY_NVCC_FLAGS=-DLMDEPLOY_DECODE_TRACE python csrc/build.py --archs 90
    python benchmark/decode_trace.py --batch 64 --context 1024 --policy 4

Each block of csrc/cuda/decode_attention_mma.cu then prints %globaltimer at its steps (entry, the length
known, q staged, q's fragments ready, warp 0's first tile in, warp 0's last tile done, the block's end)
and its SM. This script runs a few eager calls over fresh caches (kv_quant_attn.make), reads the lines
from a child process's stdout (where the device's printf goes) and prints, for the last call: the
phases' spread over blocks, the memory read rate over time (each block's bytes spread evenly over its
tile loop: where the start and the end of a call leave DRAM idle), and each SM's mean loop time (whether
some SMs stream slower than others). printf's buffer holds about 4,000 lines and printing delays later
blocks, so trace grids of one wave (batch x KV heads x slices up to 4 blocks an SM).
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys


def run(batch: int, context: int, policy: int, calls: int):
    import torch

    from kv_quant_attn import D, make
    from lmdeploy.devices.cuda import compiled
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for seed in range(calls):
        _, cache, tables, q, lens = make(batch, context, policy, 'device', seed=seed)
        out = compiled.paged_decode_attention(q, cache, tables, lens, D**-0.5, context, num_sms)
        assert out is not None, 'the compiled kernel does not take these inputs'
        torch.cuda.synchronize()


def quantiles(xs, qs=(0, 10, 50, 90, 100)):
    """min, p10, p50, p90, max of ``xs`` (ns) in us."""
    from latency import percentile
    return ' '.join(f'{percentile(xs, q) / 1e3:7.2f}' for q in qs)


def last_call(lines):
    """The TRACE rows (sm, block, entry, length known, q staged, q fragments, first tile, loop end, end) of
    the last call: calls are eager and synchronized, so more than 20 us part one's entries from the next's."""
    rows = sorted((tuple(map(int, ln.split()[1:])) for ln in lines if ln.startswith('TRACE ')), key=lambda r: r[2])
    calls = [[]]
    for r in rows:
        if calls[-1] and r[2] - calls[-1][-1][2] > 20000:
            calls.append([])
        calls[-1].append(r)
    return calls[-1]


BIN_NS = 500


def read_rate(rows, call_bytes: float):
    """Bytes read per BIN_NS from the first entry, each block's share of ``call_bytes`` spread evenly over its
    tile loop (warp 0's first tile in to its last done)."""
    t0 = min(r[2] for r in rows)
    per_block = call_bytes / len(rows)  # (slices of a context are equal but for the last)
    bins = [0.0] * ((max(r[8] for r in rows) - t0) // BIN_NS + 1)
    for r in rows:
        first, loop = r[6], r[7]
        a, b = (first - t0) / BIN_NS, (loop - t0) / BIN_NS
        if not first or b <= a:
            continue
        for k in range(int(a), min(int(b) + 1, len(bins))):
            bins[k] += per_block * (min(k + 1, b) - max(k, a)) / (b - a)
    return bins


def report(lines, call_bytes: float):
    c = last_call(lines)
    if not c:
        sys.exit('no TRACE lines: build with LMDEPLOY_NVCC_FLAGS=-DLMDEPLOY_DECODE_TRACE (see the top)')
    sm, _, entry, known, synced, qready, first, loop, end = zip(*c)
    t0 = min(entry)
    print(f'last call: {len(c)} blocks on {len(set(sm))} SMs, {(max(end) - t0) / 1e3:.2f} us from the first '
          'block\'s entry to the last block\'s end')
    print('us, over blocks:                min     p10     p50     p90     max')
    phases = [('entry, after the first', [e - t0 for e in entry]),
              ('length known, from entry', [k - e for k, e in zip(known, entry)]),
              ('q staged, from entry', [s - e for s, e in zip(synced, entry)]),
              ('q fragments, from entry', [q - e for q, e in zip(qready, entry)]),
              ('first tile in, from entry', [f - e for f, e in zip(first, entry) if f]),
              ('tile loop (warp 0)', [lp - f for lp, f in zip(loop, first) if f]),
              ('end, after warp 0\'s loop', [x - lp for x, lp in zip(end, loop)]),
              ('end, after the first entry', [x - t0 for x in end])]
    for name, xs in phases:
        print(f'  {name:28s} {quantiles(xs)}')
    print(f'read rate, TB/s a {BIN_NS / 1e3} us from the first entry (bytes of a block spread over its tile loop):')
    print('  ' + ' '.join(f'{x / BIN_NS / 1e3:.1f}' for x in read_rate(c, call_bytes)))
    per_sm = collections.defaultdict(list)
    for s, f, lp in zip(sm, first, loop):
        if f:
            per_sm[s].append(lp - f)
    means = {s: sum(v) / len(v) for s, v in per_sm.items()}
    order = sorted(means, key=means.get)
    print('mean tile loop an SM, us: fastest ' + ', '.join(f'{s}: {means[s] / 1e3:.1f}' for s in order[:6]) +
          '; slowest ' + ', '.join(f'{s}: {means[s] / 1e3:.1f}' for s in order[-6:]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--batch', type=int, default=64)
    p.add_argument('--context', type=int, default=1024)
    p.add_argument('--policy', type=int, default=4, choices=[0, 8, 4])
    p.add_argument('--calls', type=int, default=3, help='eager calls, each over a fresh cache (the last is shown)')
    p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return run(args.batch, args.context, args.policy, args.calls)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get('PYTHONPATH')])))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), '--child', *sys.argv[1:]], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr[-4000:])
    import torch

    from kv_quant_attn import BLOCK, HKV, D
    from lmdeploy.devices import get_device
    spec = get_device('cuda').kv_cache_spec(HKV, D, BLOCK, torch.bfloat16, args.policy)  # as kv_quant_attn counts
    print(f'batch {args.batch}, context {args.context}, KV policy {args.policy}, {HKV} KV heads')
    report(out.stdout.splitlines(), args.batch * args.context * spec.bytes_per_block / BLOCK)


if __name__ == '__main__':
    main()
