"""SIGTERM drains a real server process: the running stream completes, new
requests are refused, and the process exits 0. Also: prompts are logged only
up to --max-log-len."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

httpx = pytest.importorskip('httpx')
pytest.importorskip('fastapi')
pytest.importorskip('uvicorn')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = 'sk-drain'
MODEL = 'smollm2'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture
def server_proc(smollm2_path):
    port = _free_port()
    env = dict(os.environ)
    env['PYTHONPATH'] = REPO + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
    cmd = [sys.executable, '-m', 'lmdeploy.serve.openai.api_server', smollm2_path, '--server-name', '127.0.0.1',
           '--server-port', str(port), '--device', 'cpu', '--session-len', '1024', '--num-gpu-blocks', '64',
           '--api-keys', KEY, '--model-name', MODEL, '--log-level', 'INFO', '--max-log-len', '12']
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    url = f'http://127.0.0.1:{port}'
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            reader.join(5)
            pytest.fail(f'server exited with {proc.returncode}:\n{"".join(output)}')
        try:
            if httpx.get(url + '/health', timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail('server did not become healthy:\n' + ''.join(output))
        time.sleep(0.2)
    yield proc, url, output, reader
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    reader.join(10)
    proc.stdout.close()


def test_sigterm_drains_running_stream_then_exits_0(server_proc):
    proc, url, output, reader = server_proc
    headers = {'Authorization': f'Bearer {KEY}'}
    secret_tail = 'UNLOGGED-TAIL-' * 20
    body = dict(model=MODEL, messages=[{'role': 'user', 'content': 'Count: ' + secret_tail}], max_tokens=48,
                temperature=0, ignore_eos=True, stream=True, stream_options={'include_usage': True})
    first_chunk = threading.Event()
    result = {}

    def stream():
        text, usage, done, reasons = '', None, False, []
        try:
            with httpx.stream('POST', url + '/v1/chat/completions', json=body, headers=headers, timeout=120) as r:
                result['status'] = r.status_code
                for line in r.iter_lines():
                    if not line.startswith('data: '):
                        continue
                    data = line[len('data: '):]
                    if data == '[DONE]':
                        done = True
                        break
                    obj = json.loads(data)
                    usage = obj.get('usage') or usage
                    for c in obj['choices']:
                        text += c['delta'].get('content') or ''
                        if c['finish_reason']:
                            reasons.append(c['finish_reason'])
                        if c['delta'].get('content'):
                            first_chunk.set()
        except Exception as e:  # reported below
            result['error'] = repr(e)
        result.update(text=text, usage=usage, done=done, reasons=reasons)
        first_chunk.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(120)
    assert 'error' not in result, result
    engines = psutil.Process(proc.pid).children()  # the engine runs in a process of its own
    assert len(engines) == 1
    engines[0].send_signal(signal.SIGTERM)  # a group-wide SIGTERM reaches it too: it is the server's to stop
    proc.send_signal(signal.SIGTERM)
    # new requests are refused from now on (connection refused, or 503 on a kept-alive one; a connection
    # that reached the backlog just as the listener closed is reset unanswered, also a refusal)
    refused = None
    deadline = time.monotonic() + 10
    while refused is None and time.monotonic() < deadline:
        try:
            r = httpx.post(url + '/v1/chat/completions', headers=headers, timeout=5,
                           json=dict(model=MODEL, messages='hi', max_tokens=2))
            if r.status_code == 503:
                assert r.json()['error']['code'] == 'shutting_down'
                refused = '503'
        except httpx.ConnectError:
            refused = 'connect'
        except (httpx.ReadError, httpx.RemoteProtocolError):
            refused = 'reset'
        if refused is None:
            time.sleep(0.05)
    assert refused is not None, 'the draining server still accepted a new request'
    t.join(120)
    assert not t.is_alive()
    # the running stream finished normally
    assert result.get('status') == 200 and 'error' not in result, result
    assert result['done'] and result['reasons'] == ['length'], result
    assert result['usage']['completion_tokens'] == 48
    assert proc.wait(60) == 0
    psutil.wait_procs(engines, timeout=10)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engines), 'engine left behind'
    reader.join(10)
    log = ''.join(output)
    assert 'draining' in log
    # the prompt was logged, but only its first --max-log-len characters
    assert 'more]' in log and 'UNLOGGED-TAIL' not in log, log[-3000:]


def test_a_dead_engine_process_fails_requests_and_health(server_proc):
    """The engine process dies mid-stream: the stream ends with an error event, /health says 503, new
    requests get 503 at once (nothing hangs), and the server still exits on SIGTERM."""
    proc, url, output, reader = server_proc
    headers = {'Authorization': f'Bearer {KEY}'}
    engine = psutil.Process(proc.pid).children()[0]
    body = dict(model=MODEL, prompt='Count to a thousand:', max_tokens=900, ignore_eos=True, stream=True)
    events = []
    with httpx.stream('POST', url + '/v1/completions', json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith('data: '):
                events.append(line[len('data: '):])
                if len(events) == 2:
                    engine.kill()
    assert events[-1] == '[DONE]' or 'error' in events[-1]
    errors = [json.loads(e)['error'] for e in events if e != '[DONE]' and 'error' in json.loads(e)]
    assert errors and 'engine process stopped unexpectedly' in errors[0]['message'], events[-3:]
    health = httpx.get(url + '/health', timeout=10)
    assert health.status_code == 503 and health.json()['error']['code'] == 'engine_stopped'
    t0 = time.monotonic()
    r = httpx.post(url + '/v1/completions', headers=headers, timeout=30, json=dict(model=MODEL, prompt='hi',
                                                                                  max_tokens=2))
    assert r.status_code == 503 and time.monotonic() - t0 < 10, r.text
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
