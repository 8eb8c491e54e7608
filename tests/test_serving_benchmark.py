"""benchmark/serving.py end to end on the cpu device: it launches the API
server on the default model, streams a handful of Poisson-timed requests
through a real HTTP client, and reports every request and latency figure."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip('aiohttp')
pytest.importorskip('fastapi')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serving_benchmark_on_cpu(smollm2_path, tmp_path):
    out = tmp_path / 'runs.jsonl'
    cmd = [sys.executable, 'benchmark/serving.py', '--launch', smollm2_path, '--device', 'cpu', '--port', '0',
           '--num-prompts', '6', '--input-len', '24', '--output-len', '6', '--input-sigma', '0.5',
           '--output-sigma', '0.3', '--request-rate', '5', '0', '--warmup', '1', '--json', str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r['request_rate'] for r in runs] == [5.0, 0.0]
    for r in runs:
        assert r['completed'] == 6 and r['failed'] == 0 and not r['errors']
        assert r['output_throughput'] > 0 and r['request_throughput'] > 0
        ttft, tpot, itl, e2e = r['ttft_ms'], r['tpot_ms'], r['itl_ms'], r['e2e_ms']
        assert 0 < ttft[0] <= ttft[1] <= ttft[2] < e2e[2]
        assert 0 < tpot[0] and 0 < itl[0] <= itl[2]
        assert 15 <= r['mean_prompt_tokens'] <= 60  # prompts re-tokenize close to the drawn lengths
    assert 'TTFT' in proc.stdout and 'TPOT' in proc.stdout
