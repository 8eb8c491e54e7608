"""SIGTERM drains a real server process: the running stream completes, new
requests and /health get 503, and the process exits 0; a second signal ends
the running streams early, each with an error event and [DONE], and no
traceback. The port is bound before the model loads ("serving" is logged once
it listens). Also: prompts are logged only up to --max-log-len."""
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
        said_serving = any('serving' in line for line in list(output))
        try:
            if httpx.get(url + '/health', timeout=2).status_code == 200:
                break
        except httpx.ConnectError:
            assert not said_serving, 'the server said "serving" before it was listening'
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
    # new requests are refused from now on: 503 while the stream runs (the listener stays open while draining);
    # once it has finished the server stops listening (connection refused, or reset in the backlog)
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


def _stream(url, path, body, events, first):
    """Collect a stream's SSE data lines (events); ``first`` is set at the first content."""
    try:
        with httpx.stream('POST', url + path, json=body, headers={'Authorization': f'Bearer {KEY}'},
                          timeout=120) as r:
            events.append(('status', r.status_code))
            for line in r.iter_lines():
                if line.startswith('data: '):
                    events.append(('data', line[len('data: '):]))
                    first.set()
    except Exception as e:  # reported by the test
        events.append(('exception', repr(e)))
    first.set()


def test_second_signal_ends_running_streams_well_formed(server_proc):
    """Ctrl-C drains: /health and new requests answer 503 while the streams run on; a second Ctrl-C ends
    them early, each with an error event then [DONE] (no stream cut mid-way), and no traceback is printed."""
    proc, url, output, reader = server_proc
    headers = {'Authorization': f'Bearer {KEY}'}
    engines = psutil.Process(proc.pid).children()
    bodies = [('/v1/chat/completions', dict(model=MODEL, messages=[{'role': 'user', 'content': 'Count to 1000.'}],
                                            max_tokens=900, ignore_eos=True, stream=True)),
              ('/v1/completions', dict(model=MODEL, prompt='Count to 1000:', max_tokens=900, ignore_eos=True,
                                       stream=True))]
    streams = []
    for path, body in bodies:
        events, first = [], threading.Event()
        t = threading.Thread(target=_stream, args=(url, path, body, events, first))
        t.start()
        streams.append((t, events, first))
    for _, _, first in streams:
        assert first.wait(120)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    health = httpx.get(url + '/health', timeout=10)
    assert health.status_code == 503 and health.json()['error']['code'] == 'shutting_down', health.text
    late = httpx.post(url + '/v1/completions', headers=headers, timeout=10,
                      json=dict(model=MODEL, prompt='hi', max_tokens=2))
    assert late.status_code == 503 and late.json()['error']['code'] == 'shutting_down', late.text
    assert all(t.is_alive() for t, _, _ in streams), 'the streams should still be running while draining'
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    for t, _, _ in streams:
        t.join(30)
        assert not t.is_alive()
    assert time.monotonic() - t0 < 15
    for t, events, _ in streams:
        kinds = [k for k, _ in events]
        assert 'exception' not in kinds and events[0] == ('status', 200), events[-3:]
        data = [v for k, v in events if k == 'data']
        assert data[-1] == '[DONE]', data[-3:]
        error = json.loads(data[-2])['error']
        assert 'shutting down' in error['message'], error
        assert len(data) < 900  # cut short
    assert proc.wait(30) == 0
    psutil.wait_procs(engines, timeout=10)
    reader.join(10)
    log = ''.join(output)
    assert 'Traceback' not in log and 'CancelledError' not in log, log[-3000:]
    assert 'again' in log  # the second signal was acknowledged


def test_a_port_in_use_fails_before_the_model_loads(smollm2_path):
    """Checked first: the error names the address at once, and the model never loads (no 'KV cache' line,
    which the engine logs at INFO once loaded)."""
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ)
        env['PYTHONPATH'] = REPO + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
        r = subprocess.run([sys.executable, '-m', 'lmdeploy', 'serve', 'api_server', smollm2_path, '--server-name',
                            '127.0.0.1', '--server-port', str(port), '--device', 'cpu', '--log-level', 'INFO'],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert f'cannot serve on 127.0.0.1:{port}' in out and 'in use' in out, out
    assert 'serving' not in out and 'KV cache' not in out and 'Traceback' not in out, out
