"""benchmark/decode_trace.py's reading of the kernel's timestamps (the kernel side needs a GPU build with
-DLMDEPLOY_DECODE_TRACE; here: made-up lines of two calls)."""
import random

from helpers import benchmark_module


def trace_lines(rng, t_call, blocks, sms=8):
    lines, rows = [], []
    for b in range(blocks):
        entry = t_call + rng.randrange(0, 300)
        stamps = [entry]
        for step in (rng.randrange(800, 1500), rng.randrange(300, 900), rng.randrange(300, 900),
                     rng.randrange(200, 800), rng.randrange(15000, 28000), rng.randrange(900, 2500)):
            stamps.append(stamps[-1] + step)
        rows.append((b % sms, b, *stamps))
        lines.append('TRACE ' + ' '.join(map(str, rows[-1])))
    return lines, rows


def test_last_call_and_its_read_rate_keep_every_byte():
    dt = benchmark_module('decode_trace')
    rng = random.Random()
    first, _ = trace_lines(rng, 10_000, 40)
    last, rows = trace_lines(rng, 10_000 + 200_000, 56)
    lines = first + ['unrelated output'] + last
    rng.shuffle(lines)  # printf's lines come in no particular order
    got = dt.last_call(lines)
    assert sorted(got) == sorted(rows)
    call_bytes = rng.uniform(1e6, 1e8)
    bins = dt.read_rate(got, call_bytes)
    assert abs(sum(bins) - call_bytes) < 1e-6 * call_bytes
    t0 = min(r[2] for r in rows)
    assert len(bins) == (max(r[8] for r in rows) - t0) // dt.BIN_NS + 1
    # nothing is read before the first block's first tile nor after the last block's tile loop
    start, stop = (min(r[6] for r in rows) - t0) // dt.BIN_NS, (max(r[7] for r in rows) - t0) // dt.BIN_NS
    assert all(x == 0 for x in bins[:start]) and all(x == 0 for x in bins[stop + 1:]) and bins[start] > 0
