"""Offline throughput of the pipeline on a synthetic workload.

Random token-id prompts, input/output lengths drawn from lognormal
distributions (or fixed), ignore_eos so every request generates its full
length, all submitted at once. Prints requests/s and input/output tokens/s;
``--compare-hf`` also times transformers' ``generate`` on the same prompts
(one at a time, greedy), as the baseline a user would otherwise run.

    python benchmark/throughput.py --num-requests 32 --input-len 128 --output-len 64 --device cpu
"""
from __future__ import annotations

import argparse
import json
import math
import random
import threading
import time
from typing import List, Tuple


def sample_lengths(rng: random.Random, n: int, median: int, sigma: float, lo: int, hi: int) -> List[int]:
    if sigma <= 0:
        return [median] * n
    return [min(hi, max(lo, int(round(rng.lognormvariate(math.log(median), sigma))))) for _ in range(n)]


def make_workload(args, vocab_size: int) -> Tuple[List[List[int]], List[int]]:
    rng = random.Random(args.seed)
    ins = sample_lengths(rng, args.num_requests, args.input_len, args.input_sigma, 4, args.max_input_len)
    outs = sample_lengths(rng, args.num_requests, args.output_len, args.output_sigma, 4, args.max_output_len)
    # skip the first ids: small ids are often special tokens
    prompts = [[rng.randrange(100, vocab_size) for _ in range(n)] for n in ins]
    return prompts, outs


def log_compiles():
    """Print each Triton kernel variant this process compiles (or loads from
    the disk cache), with the time since the call started, so a compile in
    the middle of a run shows up with what made it a new variant."""
    from triton import knobs
    started = {}

    def before(key, repr, **_):
        started[str(key)] = time.perf_counter()
        return False  # go on and compile

    def after(key, repr, **_):
        t = time.perf_counter()
        took = t - started.pop(str(key), t)
        when = 'start-up' if _CALL_START[0] is None else f'{t - _CALL_START[0]:.2f} s into the call'
        print(f'  [triton, {when}] {took:5.2f} s {repr[:1500]}', flush=True)

    try:
        knobs.runtime.jit_cache_hook = before
        knobs.runtime.jit_post_compile_hook = after
    except AttributeError as e:  # a Triton without these hooks
        print(f'  --log-compiles: {e}')


_CALL_START = [None]  # when the timed call began


def run_lmdeploy(args, prompts, outs) -> dict:
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    cfg = PytorchEngineConfig(device_type=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size,
                              enable_prefix_caching=args.prefix_caching, eager_mode=args.eager,
                              cache_max_entry_count=args.cache_max_entry_count,
                              max_prefill_token_num=args.max_prefill_token_num,
                              prefill_interval=args.prefill_interval, quant_policy=args.quant_policy, tp=args.tp)
    if args.log_compiles:
        log_compiles()
    t0 = time.perf_counter()
    pipe = pipeline(args.model, backend_config=cfg)
    load_s = time.perf_counter() - t0
    if args.refill_slots:
        pipe.engine.scheduler.refill_slots = args.refill_slots
    if args.latency_first:
        from latency import measure, summary_line  # benchmark/, beside this file
        summary, _ = measure(pipe, 512, 256)
        print(summary_line(pipe.engine.device.name, 512, 256, summary), flush=True)
    fmt = json.loads(args.response_format) if args.response_format else None
    gens = [GenerationConfig(max_new_tokens=o, ignore_eos=True, response_format=fmt) for o in outs]
    if args.openai_mix:
        gens = openai_mix(gens, args.openai_mix, pipe.engine.model_config.vocab_size, args.seed)
    if args.warmup:
        pipe(prompts[:2], gens[:2])
    window = None
    if args.profile_at is not None:
        if args.trace_host:
            annotate_phases(pipe.engine)
        window = ProfileWindow(args.profile_at, args.profile_len, args.trace, args.trace_host)
    finished = threading.Event()
    if args.timeline:
        threading.Thread(target=timeline, args=(pipe.engine, args.timeline, finished), daemon=True).start()
    first, last = [], []  # when the first engine step started, when the latest one ended
    step = pipe.engine._step

    def timed_step(*a, **k):
        first[:] = first or [time.perf_counter()]
        if window is not None:
            window.tick()
        try:
            return step(*a, **k)
        finally:
            last[:] = [time.perf_counter()]

    pipe.engine._step = timed_step
    before = dict(pipe.engine.stats().extra)  # (--latency-first's and --warmup's steps are not the run's)
    t0 = time.perf_counter()
    _CALL_START[0] = t0
    responses = pipe(prompts, gens, use_tqdm=args.tqdm)
    elapsed = time.perf_counter() - t0
    if first:
        print(f'  first engine step {first[0] - t0:.2f} s into the call, last one done '
              f'{t0 + elapsed - last[0]:.2f} s before it returned')
    finished.set()
    if window is not None:
        window.join()
    stats = pipe.engine.stats()
    device = pipe.engine.device.name
    pipe.close()
    generated = sum(r.generate_token_len for r in responses)
    # (a grammar may end a request before its length: a finished JSON value admits only a stop token)
    assert generated == sum(outs) or args.response_format, (generated, sum(outs))
    x = {k: v - before.get(k, 0) if isinstance(v, (int, float)) else v for k, v in stats.extra.items()}
    busy = sum(x.get(f'{phase}_device_seconds', 0.0) for phase in ('prefill', 'decode'))
    print(f'  the device ran steps for {busy:.1f} s of the call\'s {elapsed:.1f} s ({100 * busy / elapsed:.1f}%; '
          'the rest it waited for the host, or the host for requests)')
    for phase in ('prefill', 'decode'):
        if x.get(f'{phase}_steps'):
            n, on_device = x[f'{phase}_steps'], x[f'{phase}_device_seconds']
            print(f"  {phase}: {n} steps, {on_device:.1f} s on the device ({1e3 * on_device / n:.1f} ms/step; "
                  f"host {x[f'{phase}_seconds']:.1f} s in the step calls), {x[f'{phase}_seqs'] / n:.1f} seqs/step, "
                  f"{x[f'{phase}_tokens'] / n:.1f} tokens/step")
    return dict(engine='lmdeploy', device=device, load_s=load_s, elapsed_s=elapsed, output_tokens=generated,
                kv_capacity_tokens=stats.num_blocks * stats.block_size, preemptions=stats.num_preemptions,
                step_stats=x)


def openai_mix(gens, fraction: float, vocab: int, seed: int):
    """Every request in ``fraction`` of them (spread evenly) asks for one of OpenAI's extra fields, in turn:
    frequency and presence penalties, a logit_bias on 8 tokens, or echo's prompt logprobs (top 1)."""
    import dataclasses
    import random
    rng = random.Random(seed)
    kinds = [dict(frequency_penalty=0.5, presence_penalty=0.3),
             None,  # logit_bias, drawn per request
             dict(prompt_logprobs=1)]
    every = max(1, round(1 / fraction))
    out = list(gens)
    for n, i in enumerate(range(0, len(gens), every)):
        kind = kinds[n % len(kinds)]
        if kind is None:
            kind = dict(logit_bias={rng.randrange(vocab): rng.uniform(-3, 3) for _ in range(8)})
        out[i] = dataclasses.replace(gens[i], **kind)
    return out


def timeline(engine, period: float, finished: threading.Event):
    """Every ``period`` seconds: steps run in the window, their time, and
    the sequences a decode step carried (where the run spends its steps)."""
    last, t0 = engine.stats().extra, time.perf_counter()
    print('  timeline: t(s) | decode steps, device ms/step, seqs/step | prefill steps, device ms/step | '
          'running, waiting')
    while not finished.wait(period):
        st, now = engine.stats(), time.perf_counter()
        x = st.extra
        d = {k: x.get(k, 0) - last.get(k, 0) for k in x}
        line = f'  {now - t0:6.1f}'
        for phase in ('decode', 'prefill'):
            n = d.get(f'{phase}_steps', 0)
            line += f' | {n:4d}, {1e3 * d.get(f"{phase}_device_seconds", 0) / max(n, 1):6.1f}'
            if phase == 'decode':
                line += f', {d.get("decode_seqs", 0) / max(n, 1):5.1f}'
        print(line + f' | {st.num_running}, {st.num_waiting}', flush=True)
        last = x


def annotate_phases(engine):
    """Name the engine loop's phases in a profile (torch.profiler ranges), so that trace_gaps.py can say what
    the host was doing while the device waited."""
    from torch.profiler import record_function

    def named(fn, label):
        def call(*a, **k):
            with record_function(f'engine.{label}'):
                return fn(*a, **k)
        return call

    for obj, name in ((engine.scheduler, 'schedule'), (engine.scheduler, 'postprocess'), (engine.runner, 'forward'),
                      (engine.runner, 'logits'), (engine.runner, 'greedy'), (engine, '_resolve'), (engine, '_sample'),
                      (engine, '_prompt_outputs')):
        setattr(obj, name, named(getattr(obj, name), name.lstrip('_')))


class ProfileWindow:
    """Profiles the steps that start from ``at`` to ``at + seconds`` into the timed call. The profiler starts
    and stops on the engine's thread, before a step (the host side of torch's profiler must start on the
    thread it records); the summary is written on a thread of its own."""

    def __init__(self, at: float, seconds: float, trace: str = None, host: bool = False):
        self.at, self.seconds, self.trace, self.host = at, seconds, trace, host
        self.prof, self.started, self.done = None, None, None

    def tick(self):
        now = time.perf_counter() - _CALL_START[0]
        if self.prof is None and self.done is None and now >= self.at:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if self.host else [])
            self.prof, self.started = profile(activities=activities), now
            self.prof.__enter__()
        elif self.prof is not None and now >= self.started + self.seconds:
            import torch
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.done = threading.Thread(target=summarize_profile, args=(self.prof, now - self.started, self.trace))
            self.done.start()
            self.prof = None

    def join(self):
        if self.prof is not None:  # the run ended inside the window
            self.prof.__exit__(None, None, None)
            summarize_profile(self.prof, time.perf_counter() - _CALL_START[0] - self.started, self.trace)
        elif self.done is not None:
            self.done.join()


def summarize_profile(prof, seconds: float, trace: str = None):
    """How busy the GPU was: kernel time over the window (the rest is the
    device waiting for the host), and the kernels that fill it. ``trace``:
    also write the window as a gzipped Chrome trace (trace_gaps.py reads
    it)."""
    if trace:
        import gzip
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, 'trace.json')
            prof.export_chrome_trace(raw)
            with open(raw, 'rb') as src, gzip.open(trace, 'wb') as dst:
                dst.write(src.read())
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(f'  GPU busy {100 * busy / seconds:.1f}% of a {seconds:.1f} s window (kernel time {busy:.3f} s)')
    groups = {}
    for e in events:
        name = 'GEMM (cuBLAS)' if any(w in e.key.lower() for w in ('gemm', 'nvjet', 'cutlass', 'xmma', 'splitk')) \
            else e.key[:50]
        t, n = groups.get(name, (0.0, 0))
        groups[name] = (t + e.self_device_time_total / 1e6, n + e.count)
    for name, (t, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:16]:
        print(f'  {100 * t / max(busy, 1e-9):5.1f}%  {t:7.3f} s  {n:7d} launches  {name}')
    # idle stretches between kernels (the device waiting for the host)
    from torch.autograd import DeviceType
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    gaps, end = [], spans[0][1] if spans else 0
    for s, e in spans[1:]:
        if s > end:
            gaps.append(s - end)
        end = max(end, e)
    big = sorted(g for g in gaps if g > 50)
    print(f'  idle: {sum(gaps) / 1e3:.1f} ms in {len(gaps)} gaps; {len(big)} gaps over 50 us '
          f'({sum(big) / 1e3:.1f} ms, largest {[round(g / 1e3, 2) for g in big[-5:]]} ms)')


def run_hf(args, prompts, outs) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from lmdeploy.default_model import resolve_model_path
    dtype = {'auto': torch.float32, 'float32': torch.float32, 'bfloat16': torch.bfloat16,
             'float16': torch.float16}[args.dtype]
    device = 'cuda' if args.device in ('cuda', 'auto') and torch.cuda.is_available() else 'cpu'
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=dtype).to(device).eval()
    t0 = time.perf_counter()
    generated = 0
    with torch.no_grad():
        for ids, n in zip(prompts, outs):
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            generated += y.shape[1] - x.shape[1]
    return dict(engine='transformers', device=device, elapsed_s=time.perf_counter() - t0, output_tokens=generated)


def report(result: dict, prompts, outs) -> dict:
    n, elapsed = len(prompts), result['elapsed_s']
    ins = sum(len(p) for p in prompts)
    result.update(requests=n, input_tokens=ins, requests_per_s=n / elapsed, input_tokens_per_s=ins / elapsed,
                  output_tokens_per_s=result['output_tokens'] / elapsed,
                  total_tokens_per_s=(ins + result['output_tokens']) / elapsed)
    print(f"[{result['engine']} on {result['device']}] {n} requests in {elapsed:.2f} s: "
          f"{result['requests_per_s']:.2f} req/s, input {result['input_tokens_per_s']:.1f} tok/s, "
          f"output {result['output_tokens_per_s']:.1f} tok/s, total {result['total_tokens_per_s']:.1f} tok/s"
          + (f", KV capacity {result['kv_capacity_tokens']} tokens, {result['preemptions']} preemptions"
             if 'kv_capacity_tokens' in result else '')
          + (f", loaded in {result['load_s']:.1f} s" if 'load_s' in result else ''))
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default=None, help='HF model dir (default: embedded SmolLM2-135M)')
    p.add_argument('--device', default='auto')
    p.add_argument('--dtype', default='auto')
    p.add_argument('--num-requests', type=int, default=64)
    p.add_argument('--input-len', type=int, default=128, help='median input length')
    p.add_argument('--output-len', type=int, default=64, help='median output length')
    p.add_argument('--input-sigma', type=float, default=0.0, help='lognormal sigma (0: fixed length)')
    p.add_argument('--output-sigma', type=float, default=0.0)
    p.add_argument('--max-input-len', type=int, default=2000)
    p.add_argument('--max-output-len', type=int, default=1000)
    p.add_argument('--max-batch-size', type=int, default=None)
    p.add_argument('--max-prefill-token-num', type=int, default=8192)
    p.add_argument('--cache-max-entry-count', type=float, default=0.8)
    p.add_argument('--prefix-caching', action='store_true')
    p.add_argument('--quant-policy', type=int, default=0, choices=(0, 4, 8), help='KV cache int8 (8) / int4 (4)')
    p.add_argument('--prefill-interval', type=int, default=16,
                   help='graph devices: at most this many decode steps between prefill steps')
    p.add_argument('--refill-slots', type=int, default=0,
                   help='graph devices: free batch slots that call for a prefill step (default: 1/32 of the batch)')
    p.add_argument('--response-format', default=None,
                   help='structured output for every request: a response_format as JSON, e.g. \'{"type": '
                   '"json_schema", "json_schema": {"name": "t", "schema": {...}}}\' (needs xgrammar)')
    p.add_argument('--openai-mix', type=float, default=0.0,
                   help="this fraction of requests ask for penalties, a logit_bias or echo's prompt logprobs, in "
                   'turn (the rest are plain)')
    p.add_argument('--eager', action='store_true')
    p.add_argument('--tp', type=int, default=1, help='tensor parallelism (GPUs)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--warmup', action='store_true')
    p.add_argument('--latency-first', action='store_true',
                   help="first time batch 1 (512 in / 256 out, latency.py's runs) on the same engine: a model "
                   'that takes minutes to load loads once')
    p.add_argument('--tqdm', action='store_true')
    p.add_argument('--profile-at', type=float, default=None,
                   help='seconds into the run: profile the GPU for --profile-len seconds from there')
    p.add_argument('--profile-len', type=float, default=1.0)
    p.add_argument('--trace', default=None, help='with --profile-at: write the window as a gzipped Chrome trace')
    p.add_argument('--trace-host', action='store_true',
                   help="with --trace: record the host's ops and the engine loop's phases too")
    p.add_argument('--timeline', type=float, default=0.0,
                   help='print step counts and times every this many seconds of the run (best effort: '
                   'the printing thread competes with the engine for the GIL, so lines can come late)')
    p.add_argument('--log-compiles', action='store_true',
                   help='print every Triton kernel variant compiled (times from the start of the timed call)')
    p.add_argument('--compare-hf', action='store_true', help='also time transformers.generate')
    p.add_argument('--json', default=None, help='write the results here')
    args = p.parse_args()

    from lmdeploy.default_model import resolve_model_path
    from lmdeploy.engine.model_config import load_model_config
    vocab = load_model_config(resolve_model_path(args.model)).vocab_size
    prompts, outs = make_workload(args, vocab)
    results = [report(run_lmdeploy(args, prompts, outs), prompts, outs)]
    if args.compare_hf:
        results.append(report(run_hf(args, prompts, outs), prompts, outs))
        speedup = results[0]['output_tokens_per_s'] / results[1]['output_tokens_per_s']
        print(f'speedup over transformers: {speedup:.2f}x')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=2)


if __name__ == '__main__':
    main()
