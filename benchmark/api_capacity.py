"""How many streamed tokens a second the API server's own process can carry, with no model.

The API server launched here runs the real engine process with the model
taken out (bench_utils.stub_model) and each step padded to ``--step-ms``, a
GPU's pace: the engine produces tokens as fast as a GPU would, so what limits
the streams is the API process (detokenizing, SSE JSON, HTTP writes, the
socket from the engine) and the client. Prints serving.py's summary plus the
API process's CPU time per streamed token and the SSE events it
wrote per token (below 1 when outputs that piled up were folded together).

    python benchmark/api_capacity.py --request-rate 50 --num-prompts 400 --step-ms 8
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

import serving

# imported by every process of the launched server (it is first on PYTHONPATH); only the engine's is patched
_SITECUSTOMIZE = '''
import os, time
if os.environ.get('LMDEPLOY_STUB_STEP_MS'):
    import torch
    from lmdeploy.engine import engine as _engine

    _init = _engine.Engine.__init__

    def _stubbed(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        runner, step = self.runner, float(os.environ['LMDEPLOY_STUB_STEP_MS']) / 1e3
        hidden, vocab = self.model_config.hidden_size, self.model_config.vocab_size
        top = torch.zeros(self.config.max_prefill_token_num + 512, vocab)
        top[:, int(os.environ['LMDEPLOY_STUB_TOKEN'])] = 1.0  # every step picks one plain word
        last = [time.perf_counter()]

        def forward(ids, positions, ctx):
            wait = last[0] + step - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            last[0] = time.perf_counter()
            return torch.empty(ids.shape[0], hidden)

        runner._eager_forward = forward
        runner.logits = lambda h, rows=None: top[:h.shape[0]]
        runner.greedy = lambda h, rows=None: torch.zeros(h.shape[0], dtype=torch.int64)

    _engine.Engine.__init__ = _stubbed
'''


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its threads (Linux /proc)."""
    with open(f'/proc/{pid}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--model', default='default', help="whose tokenizer and config ('default': the embedded model)")
    p.add_argument('--step-ms', type=float, default=8.0, help='the emulated device time of a step')
    p.add_argument('--request-rate', type=float, default=50.0)
    p.add_argument('--max-concurrency', type=int, default=0)
    p.add_argument('--num-prompts', type=int, default=400)
    p.add_argument('--input-len', type=int, default=150)
    p.add_argument('--output-len', type=int, default=140)
    p.add_argument('--max-batch-size', type=int, default=256)
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from lmdeploy.default_model import resolve_model_path
    model = resolve_model_path(None if args.model == 'default' else args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    token = tokenizer.encode(' the', add_special_tokens=False)[-1]
    site = tempfile.mkdtemp(prefix='lmdeploy-stub-')
    with open(os.path.join(site, 'sitecustomize.py'), 'w') as f:
        f.write(_SITECUSTOMIZE)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, LMDEPLOY_STUB_STEP_MS=str(args.step_ms), LMDEPLOY_STUB_TOKEN=str(token),
               PYTHONPATH=os.pathsep.join([site, repo] + ([os.environ['PYTHONPATH']] if 'PYTHONPATH' in os.environ
                                                          else [])))
    import socket
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, '-m', 'lmdeploy', 'serve', 'api_server', model, '--server-name', '127.0.0.1',
           '--server-port', str(port), '--device', 'cpu', '--log-level', 'WARNING', '--max-batch-size',
           str(args.max_batch_size), '--session-len', '4096']
    proc = subprocess.Popen(cmd, env=env)
    url = f'http://127.0.0.1:{port}'
    try:
        serving.wait_healthy(url, proc, 300)
        ns = argparse.Namespace(seed=args.seed, num_prompts=args.num_prompts, input_len=args.input_len,
                                output_len=args.output_len, input_sigma=0.9, output_sigma=0.9, max_input_len=2000,
                                max_output_len=1000, prompt_format='ids')
        reqs = serving.make_requests(tokenizer, ns)
        name = serving.model_name(url, None)
        cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
        results, elapsed = asyncio.run(serving.run(url, name, reqs, args.request_rate, args.max_concurrency, False,
                                                   None, args.seed, 600))
        cpu = cpu_seconds(proc.pid) - cpu0
        wall = time.perf_counter() - t0
        s = serving.summarize(results, elapsed)
        serving.print_summary(s, f'stub engine, {args.step_ms} ms steps, rate {args.request_rate} req/s')
        tokens = sum(r.output_tokens for r in results if r.ok)
        events = sum(len(r.itl) + 1 for r in results if r.ok)
        print(f'API process: {cpu:.1f} CPU s over {wall:.1f} s ({100 * cpu / wall:.0f} % of a core), '
              f'{1e6 * cpu / max(1, tokens):.1f} CPU us per token, {events / max(1, tokens):.2f} events a token')
        return 1 if s['failed'] else 0
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == '__main__':
    sys.exit(main())
