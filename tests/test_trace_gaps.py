"""benchmark/trace_gaps.py's account of where the device waited, on a made-up trace: kernels on the device with
gaps, the engine loop's phases and host ops on one host thread (the thread with the most engine ranges; another
thread's ranges must not count)."""
import gzip
import json
import random

from helpers import benchmark_module

PHASES = ('engine.schedule', 'engine.forward', 'engine.resolve', 'engine.sample')


def made_up_trace(rng, path):
    """Phases back to back on thread 7, each holding one host op; kernels with a random gap in some phases.
    Returns the expected idle (us) by phase and by (phase, op) for gaps over 20 us."""
    events, want_phase, want_op = [], {}, {}
    t, kt = 0.0, 0.0
    for i in range(60):
        phase = rng.choice(PHASES)
        length = rng.uniform(200, 600)
        op = rng.choice(('cudaGraphLaunch', 'aten::copy_', 'cudaStreamSynchronize'))
        events.append(dict(ph='X', cat='user_annotation', name=phase, ts=t, dur=length, tid=7, pid=1))
        events.append(dict(ph='X', cat='cpu_op' if op.startswith('aten') else 'cuda_runtime', name=op,
                           ts=t + 1, dur=length - 2, tid=7, pid=1))
        if i % 3 == 0:  # a decoy on another thread (fewer of them), longer and covering the same time
            events.append(dict(ph='X', cat='user_annotation', name='engine.other', ts=t - 5, dur=length + 10,
                               tid=9, pid=1))
        # the device: one kernel from the phase's start to its middle less half a gap, the next one from the
        # middle plus half the gap to the phase's end
        mid = t + length / 2
        gap = rng.choice((0.0, 5.0, rng.uniform(25, 150)))
        events.append(dict(ph='X', cat='kernel', name=f'k{i}', ts=kt, dur=mid - gap / 2 - kt, pid=0, tid=0))
        if gap > 20:
            want_phase[phase] = want_phase.get(phase, 0.0) + gap
            want_op[(phase, op)] = want_op.get((phase, op), 0.0) + gap
        kt = mid + gap / 2
        events.append(dict(ph='X', cat='kernel', name=f'k{i}b', ts=kt, dur=t + length - kt, pid=0, tid=0))
        kt = t + length
        t += length
    rng.shuffle(events)
    with gzip.open(path, 'wt') as f:
        json.dump(dict(traceEvents=events), f)
    return want_phase, want_op


def test_idle_is_charged_to_the_engine_threads_phase_and_op(tmp_path):
    tg = benchmark_module('trace_gaps')
    rng = random.Random()
    path = str(tmp_path / 'trace.json.gz')
    want_phase, want_op = made_up_trace(rng, path)
    events = tg.load(path)
    phases, ops = tg.load_host(path)
    assert {name for *_, name in phases} <= set(PHASES)
    by_phase, by_op = tg.idle_by_host(events, phases, ops)
    assert set(by_phase) == set(want_phase)
    for phase, t in want_phase.items():
        assert abs(by_phase[phase] - t) < 1e-6 * max(1.0, t)
    assert set(by_op) == set(want_op)
    for key, t in want_op.items():
        assert abs(by_op[key] - t) < 1e-6 * max(1.0, t)


def test_a_trace_without_the_host_side_has_no_phases(tmp_path):
    tg = benchmark_module('trace_gaps')
    path = str(tmp_path / 'trace.json.gz')
    with gzip.open(path, 'wt') as f:
        json.dump(dict(traceEvents=[dict(ph='X', cat='kernel', name='k', ts=0.0, dur=5.0)]), f)
    assert tg.load_host(path) == ([], [])
