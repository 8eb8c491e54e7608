"""Online serving benchmark: streaming requests to an OpenAI-compatible server.

Starts ``lmdeploy serve api_server`` (``--launch MODEL``) or targets a
running server (``--url``, any OpenAI-compatible one, vLLM's included),
sends streaming ``/v1/completions`` (or ``/v1/chat/completions``) requests
from a real HTTP client at a Poisson request rate or a fixed concurrency,
and prints request throughput, output tokens/s, time to first token (TTFT),
time per output token after the first (TPOT), inter-token latency (ITL) and
end-to-end latency at p50/p90/p99, and the failed requests (an error status,
a cut stream, or fewer tokens than asked for).

Workload (as LMDeploy's and vLLM's serving benchmarks): prompt and output
lengths lognormal around the given medians, clipped; prompts are text made
of random vocabulary tokens (re-tokenized to the wanted length), outputs
exact (``ignore_eos`` with ``max_tokens`` = ``min_tokens``).

    python benchmark/serving.py --launch /tmp/l8b --device cuda --request-rate 20 --num-prompts 800
    python benchmark/serving.py --url http://127.0.0.1:8000 --tokenizer /tmp/l8b --request-rate 35
    python benchmark/serving.py --launch default --device cpu --num-prompts 8 --input-len 32 --output-len 16
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

import numpy as np


@dataclass
class Request:
    prompt: Union[str, List[int]]  # text, or token ids (sent as OpenAI's list-of-ids prompt)
    prompt_len: int
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ''
    start: float = 0.0  # seconds after the run's first request
    ttft: float = 0.0
    latency: float = 0.0
    itl: List[float] = field(default_factory=list)  # seconds between consecutive chunks with text
    output_tokens: int = 0
    prompt_tokens: int = 0


# ------------------------------------------------------------------ workload
def lognormal_lengths(rng: np.random.Generator, n: int, median: int, sigma: float, lo: int, hi: int) -> List[int]:
    if sigma <= 0:
        return [median] * n
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int).tolist()


def text_of_length(tokenizer, rng: random.Random, length: int, vocab: List[int]):
    """(text of random vocabulary tokens that re-tokenizes to ``length`` tokens where it can, its token count):
    the ids are decoded, re-encoded and trimmed or extended until the count is exact."""
    ids = [rng.choice(vocab) for _ in range(length)]
    got = length
    for _ in range(8):
        text = tokenizer.decode(ids)
        enc = tokenizer.encode(text, add_special_tokens=False)
        got = len(enc)
        if got == length:
            break
        ids = enc[:length] if got > length else enc + [rng.choice(vocab) for _ in range(length - got)]
    return text, got


# workload shapes: lengths (medians, sigmas, clips) and arrivals; the first is the table
SHAPES: Dict[str, dict] = {
    'sharegpt-like': dict(input_len=150, output_len=140, input_sigma=0.9, output_sigma=0.9, max_input_len=2000,
                          max_output_len=1000, burstiness=1.0),
    'prefill-heavy': dict(input_len=1500, output_len=100, input_sigma=0.3, output_sigma=0.3, max_input_len=3000,
                          max_output_len=300, burstiness=1.0),
    'decode-heavy': dict(input_len=100, output_len=800, input_sigma=0.3, output_sigma=0.3, max_input_len=300,
                         max_output_len=2000, burstiness=1.0),
    'bursty': dict(input_len=150, output_len=140, input_sigma=0.9, output_sigma=0.9, max_input_len=2000,
                   max_output_len=1000, burstiness=0.5),
}


def make_requests(tokenizer, args) -> List[Request]:
    rng = np.random.default_rng(args.seed)
    prng = random.Random(args.seed)
    ins = lognormal_lengths(rng, args.num_prompts, args.input_len, args.input_sigma, 4, args.max_input_len)
    outs = lognormal_lengths(rng, args.num_prompts, args.output_len, args.output_sigma, 4, args.max_output_len)
    special = set(tokenizer.all_special_ids)
    # plain word pieces (letters and digits), so text round-trips closely
    vocab = [i for i in range(min(len(tokenizer), 60000)) if i not in special
             and tokenizer.decode([i]).strip().isalnum()][:20000]
    reqs = []
    for n_in, n_out in zip(ins, outs):
        if getattr(args, 'prompt_format', 'text') == 'ids':
            reqs.append(Request([prng.choice(vocab) for _ in range(n_in)], n_in, n_out))
        else:
            text, got = text_of_length(tokenizer, prng, n_in, vocab)
            reqs.append(Request(text, got, n_out))
    return reqs


def arrival_gaps(rng: np.random.Generator, n: int, rate: float, burstiness: float = 1.0) -> List[float]:
    """Seconds between consecutive requests: gamma with shape ``burstiness`` and mean 1 / rate (1: Poisson;
    below 1 burstier: arrivals bunch together with longer quiet gaps); rate 0: all at once."""
    if rate <= 0:
        return [0.0] * n
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), n).tolist()


# -------------------------------------------------------------------- client
async def send(session, url: str, model: str, req: Request, chat: bool, api_key: Optional[str]) -> Result:
    import aiohttp
    body = dict(model=model, max_tokens=req.output_len, min_tokens=req.output_len, ignore_eos=True,
                temperature=0.0, stream=True, stream_options={'include_usage': True})
    if chat:
        if not isinstance(req.prompt, str):
            raise ValueError('--chat needs text prompts (--prompt-format text)')
        body['messages'] = [{'role': 'user', 'content': req.prompt}]
        path = '/v1/chat/completions'
    else:
        body['prompt'] = req.prompt
        path = '/v1/completions'
    headers = {'Authorization': f'Bearer {api_key}'} if api_key else {}
    res = Result(prompt_tokens=req.prompt_len)
    start = time.perf_counter()
    last = None
    chunks, done = 0, False
    try:
        async with session.post(url + path, json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f'HTTP {resp.status}: {(await resp.text())[:200]}'
                return res
            buf = b''
            async for data in resp.content.iter_any():
                buf += data
                while b'\n\n' in buf:
                    event, buf = buf.split(b'\n\n', 1)
                    line = event.strip()
                    if not line.startswith(b'data:'):
                        continue
                    payload = line[5:].strip()
                    if payload == b'[DONE]':
                        done = True
                        continue
                    obj = json.loads(payload)
                    if 'error' in obj:
                        res.error = f"stream error: {obj['error'].get('message', '')[:200]}"
                        return res
                    if obj.get('usage'):
                        res.output_tokens = obj['usage'].get('completion_tokens', 0)
                        res.prompt_tokens = obj['usage'].get('prompt_tokens', res.prompt_tokens)
                    for c in obj.get('choices') or []:
                        text = c.get('text') if not chat else (c.get('delta') or {}).get('content')
                        if text:
                            now = time.perf_counter()
                            if last is None:
                                res.ttft = now - start
                            else:
                                res.itl.append(now - last)
                            last = now
                            chunks += 1
        res.latency = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f'{type(e).__name__}: {e}'
        return res
    if not done:
        res.error = 'the stream ended without [DONE]'
    elif res.output_tokens == 0:
        res.output_tokens = chunks  # a server that sends no usage: one chunk a token
    if not res.error and res.output_tokens < req.output_len:
        res.error = f'{res.output_tokens} of {req.output_len} tokens'
    res.ok = not res.error
    return res


async def run(url: str, model: str, reqs: List[Request], rate: float, concurrency: int, chat: bool,
              api_key: Optional[str], seed: int, timeout: float, burstiness: float = 1.0):
    import aiohttp
    gaps = arrival_gaps(np.random.default_rng(seed + 1), len(reqs), rate, burstiness)
    sem = asyncio.Semaphore(concurrency if concurrency > 0 else len(reqs))
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    results: List[Optional[Result]] = [None] * len(reqs)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:

        async def one(i: int, req: Request):
            async with sem:
                t = time.perf_counter() - start
                results[i] = await send(session, url, model, req, chat, api_key)
                results[i].start = t

        tasks = []
        start = time.perf_counter()
        for i, req in enumerate(reqs):
            tasks.append(asyncio.create_task(one(i, req)))
            if rate > 0 and i + 1 < len(reqs):
                await asyncio.sleep(gaps[i])
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return results, elapsed


# ------------------------------------------------------------------- report
def percentiles(values: List[float], ps=(50, 90, 99)) -> List[float]:
    if not values:
        return [float('nan')] * len(ps)
    return [float(np.percentile(values, p)) for p in ps]


def summarize(results: List[Result], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    return dict(
        completed=len(ok), failed=len(results) - len(ok), elapsed_s=elapsed,
        request_throughput=len(ok) / elapsed, output_throughput=out_tokens / elapsed,
        total_throughput=(out_tokens + sum(r.prompt_tokens for r in ok)) / elapsed,
        mean_prompt_tokens=float(np.mean([r.prompt_tokens for r in ok])) if ok else 0.0,
        ttft_ms=[1e3 * x for x in percentiles([r.ttft for r in ok])],
        tpot_ms=[1e3 * x for x in percentiles(tpot)],
        itl_ms=[1e3 * x for x in percentiles(itl)],
        e2e_ms=[1e3 * x for x in percentiles([r.latency for r in ok])],
        mean_ttft_ms=1e3 * float(np.mean([r.ttft for r in ok])) if ok else float('nan'),
        mean_tpot_ms=1e3 * float(np.mean(tpot)) if tpot else float('nan'),
        errors=sorted({r.error for r in results if not r.ok})[:5])


def print_summary(s: dict, title: str):
    print(f'==== {title} ====')
    print(f"completed {s['completed']}, failed {s['failed']}, {s['elapsed_s']:.1f} s")
    print(f"requests/s {s['request_throughput']:.2f}   output tok/s {s['output_throughput']:.0f}   "
          f"total tok/s {s['total_throughput']:.0f}   mean prompt tokens {s['mean_prompt_tokens']:.0f}")
    for name in ('ttft', 'tpot', 'itl', 'e2e'):
        p50, p90, p99 = s[f'{name}_ms']
        print(f'{name.upper():5s} ms  p50 {p50:9.1f}   p90 {p90:9.1f}   p99 {p99:9.1f}')
    for e in s['errors']:
        print('error:', e)
    sys.stdout.flush()


# ------------------------------------------------------------------ servers
def wait_healthy(url: str, proc: Optional[subprocess.Popen], timeout: float):
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f'the server exited with code {proc.returncode}')
        try:
            with urllib.request.urlopen(url + '/health', timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError(f'{url} was not healthy after {timeout} s')


def launch(args):
    """(the server process, its URL); port 0 picks a free one."""
    if args.port == 0:
        import socket
        with socket.socket() as sock:
            sock.bind(('127.0.0.1', 0))
            args.port = sock.getsockname()[1]
    cmd = [sys.executable, '-m', 'lmdeploy', 'serve', 'api_server', args.launch, '--server-name', '127.0.0.1',
           '--server-port', str(args.port), '--device', args.device, '--log-level', 'WARNING'] + args.server_args
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env['PYTHONPATH'] = repo + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
    print('launching:', ' '.join(cmd), flush=True)
    return subprocess.Popen(cmd, env=env), f'http://127.0.0.1:{args.port}'


def scrape(url: str, api_key: Optional[str]) -> Dict[str, float]:
    """The server's Prometheus counters that say where its time went (this project's names; {} for a server
    without them): the API process's CPU seconds and the engine's steps, tokens and seconds by phase."""
    import urllib.request
    req = urllib.request.Request(url + '/metrics', headers={'Authorization': f'Bearer {api_key}'} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
    except Exception:
        return {}
    got = {}
    for line in text.splitlines():
        if line.startswith(('process_cpu_seconds_total', 'lmdeploy_engine_step_')):
            name, _, value = line.rpartition(' ')
            got[name.replace('lmdeploy_engine_step_', '').replace('_total', '')] = float(value)
    return got


def server_side(before: Dict[str, float], after: Dict[str, float], elapsed: float) -> dict:
    """What the counters say about one run: the API process's share of a core, and each phase's steps."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    out = {}
    if 'process_cpu_seconds' in d:
        out['api_cpu_share'] = d['process_cpu_seconds'] / elapsed
    for phase in ('prefill', 'decode'):
        n = d.get(f'steps{{phase="{phase}"}}', 0.0)
        if n:
            out[f'{phase}_steps'] = int(n)
            out[f'{phase}_tokens_per_step'] = d.get(f'tokens{{phase="{phase}"}}', 0.0) / n
            out[f'{phase}_device_ms_per_step'] = 1e3 * d.get(f'device_seconds{{phase="{phase}"}}', 0.0) / n
    return out


def model_name(url: str, api_key: Optional[str]) -> str:
    import urllib.request
    req = urllib.request.Request(url + '/v1/models', headers={'Authorization': f'Bearer {api_key}'} if api_key else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)['data'][0]['id']


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument('--launch', metavar='MODEL', help="start lmdeploy serve api_server MODEL ('default': "
                       'the embedded model) and stop it at the end')
    where.add_argument('--url', help='an OpenAI-compatible server already running')
    p.add_argument('--device', default='auto', help='--device of the launched server')
    p.add_argument('--port', type=int, default=23333, help='port of the launched server (0: a free one)')
    p.add_argument('--server-args', nargs=argparse.REMAINDER, default=[],
                   help='further flags of the launched server (everything after this flag)')
    p.add_argument('--tokenizer', help='for the prompts (default: the launched model)')
    p.add_argument('--model', help='the model name to send (default: the first of /v1/models)')
    p.add_argument('--api-key', default=None)
    p.add_argument('--chat', action='store_true', help='/v1/chat/completions instead of /v1/completions')
    p.add_argument('--num-prompts', type=int, default=800)
    p.add_argument('--request-rate', type=float, nargs='+', default=[20.0],
                   help='requests/s, Poisson arrivals (several: one run each); 0 = all at once')
    p.add_argument('--max-concurrency', type=int, default=0, help='most requests in flight (0: no limit)')
    p.add_argument('--input-len', type=int, default=150, help='median prompt tokens')
    p.add_argument('--output-len', type=int, default=140, help='median output tokens')
    p.add_argument('--input-sigma', type=float, default=0.9)
    p.add_argument('--output-sigma', type=float, default=0.9)
    p.add_argument('--max-input-len', type=int, default=2000)
    p.add_argument('--max-output-len', type=int, default=1000)
    p.add_argument('--shape', choices=sorted(SHAPES), help='a workload shape: its lengths and arrivals become the '
                   'defaults of the flags above and --burstiness (sharegpt-like: the defaults)')
    p.add_argument('--burstiness', type=float, default=1.0, help='gamma arrivals of this shape (1: Poisson; '
                   'below 1: burstier)')
    p.add_argument('--prompt-format', choices=['text', 'ids'], default='text',
                   help='prompts as text (re-tokenizing to the drawn length) or as token ids')
    p.add_argument('--warmup', type=int, default=0, help='requests sent (and not counted) before each run (0: '
                   'none, so a freshly launched server\'s first run shows what a cold start costs)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--timeout', type=float, default=600, help='seconds a request may take')
    p.add_argument('--start-timeout', type=float, default=900, help='seconds a launched server may take to start')
    p.add_argument('--stop-above', type=float, default=0, metavar='MS', help='stop the rates (ascending) after '
                   'the first whose TTFT p99 exceeds MS milliseconds (0: run them all)')
    p.add_argument('--json', help='append each run\'s summary to this file (JSON lines)')
    p.add_argument('--save-requests', action='store_true', help='with --json: each request\'s lengths and times too')
    shape = p.parse_known_args(argv)[0].shape
    if shape:
        p.set_defaults(**SHAPES[shape])
    args = p.parse_args(argv)

    from transformers import AutoTokenizer
    proc = None
    url = args.url.rstrip('/') if args.url else None
    if args.launch:
        from lmdeploy.default_model import resolve_model_path
        args.launch = resolve_model_path(None if args.launch == 'default' else args.launch)
        proc, url = launch(args)
    try:
        wait_healthy(url, proc, args.start_timeout)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.launch)
        model = args.model or model_name(url, args.api_key)
        reqs = make_requests(tokenizer, args)
        gc.collect()  # no full collection of the prompts and the tokenizer mid-run (it would show as latency)
        gc.freeze()
        if args.warmup:
            warm = [Request(r.prompt, r.prompt_len, 8) for r in reqs[:args.warmup]]
            asyncio.run(run(url, model, warm, 0, 0, args.chat, args.api_key, args.seed, args.timeout))
        failed = 0
        for rate in args.request_rate:
            before = scrape(url, args.api_key)
            results, elapsed = asyncio.run(run(url, model, reqs, rate, args.max_concurrency, args.chat,
                                               args.api_key, args.seed, args.timeout, args.burstiness))
            s = summarize(results, elapsed)
            s['server'] = server_side(before, scrape(url, args.api_key), elapsed) if before else {}
            if args.save_requests:
                s['requests'] = [dict(start=r.start, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
                                      ttft_ms=1e3 * r.ttft, e2e_ms=1e3 * r.latency,
                                      max_itl_ms=1e3 * max(r.itl, default=0.0), error=r.error) for r in results]
            s.update(request_rate=rate, max_concurrency=args.max_concurrency, num_prompts=args.num_prompts,
                     input_len=args.input_len, output_len=args.output_len, url=url, model=model,
                     shape=args.shape, burstiness=args.burstiness, prompt_format=args.prompt_format,
                     endpoint='chat' if args.chat else 'completions')
            print_summary(s, f'rate {rate or "inf"} req/s' + (f', concurrency {args.max_concurrency}'
                                                              if args.max_concurrency else ''))
            if s['server']:
                print('server: ' + '   '.join(f'{k} {v:.3g}' for k, v in s['server'].items()))
            failed += s['failed']
            if args.json:
                with open(args.json, 'a') as f:
                    f.write(json.dumps(s) + '\n')
            if args.stop_above and not s['ttft_ms'][2] <= args.stop_above:
                print(f'TTFT p99 above {args.stop_above:g} ms: the higher rates are not run')
                break
        return 1 if failed else 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == '__main__':
    sys.exit(main())
