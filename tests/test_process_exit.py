"""A program that uses a pipeline ends when it ends, whatever the engine: it returns without close(), its
code raises, Ctrl-C, SIGTERM. Each case runs a real script (CPU, gloo for tp=2) and checks, within a time
limit, that the script exited and that no process it started (workers, the engine process, Ray's) and no
/dev/shm entry outlives it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import atexit, signal, sys, threading
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job ignores it)
    model, tp, backend, engine_process, case, device = sys.argv[1:]

    def teardown_state():  # registered first, so it runs after lmdeploy's own exit handler
        import torch.distributed as dist
        busy = [t.name for t in threading.enumerate() if t.name in ('lmdeploy-engine', 'lmdeploy-pipeline')]
        print('at teardown: group', 'initialized' if dist.is_initialized() else 'destroyed', 'threads', busy,
              flush=True)
    atexit.register(teardown_state)
    if backend == 'ray':
        import ray
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    pipe = pipeline(model, backend_config=PytorchEngineConfig(
        device_type=device, dtype='float32' if device == 'cpu' else 'auto', tp=int(tp),
        distributed_executor_backend=backend,
        engine_process=engine_process == '1', session_len=256, num_gpu_blocks=16, block_size=16))
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    assert pipe([[5, 6, 7], [8, 9]], gen)[0].generate_token_len == 4
    print('ready', flush=True)
    if case == 'raise':
        raise RuntimeError('the user code failed')
    if case == 'busy_raise':  # a request still generating on another thread (a daemon thread inside torch)
        started = threading.Event()
        def stream():
            for _ in pipe.stream_infer([5, 6, 7], GenerationConfig(max_new_tokens=240, ignore_eos=True)):
                started.set()
        threading.Thread(target=stream, daemon=True).start()
        started.wait(60)
        raise RuntimeError('the user code failed')
    if case == 'signal':  # generating when the signal comes
        while True:
            pipe([5, 6, 7], GenerationConfig(max_new_tokens=200, ignore_eos=True))
''')


def _shm():
    try:
        return set(os.listdir('/dev/shm'))
    except FileNotFoundError:
        return set()


def _alive(procs):
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f'{p.pid} {" ".join(p.cmdline())[:100]}')
        except psutil.NoSuchProcess:
            pass
    return left


def _run(model, case, tp=2, backend='mp', engine_process=False, sig=None, limit=20.0):
    """Run the script to 'ready', then let it end (``case``; ``sig`` sent while it generates): returns
    (exit code, seconds from 'ready' or the signal to its exit, its output)."""
    shm = _shm()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    proc = subprocess.Popen([sys.executable, '-c', SCRIPT, model, str(tp), backend, '1' if engine_process else '0',
                             case, DEVICE], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    family = []
    try:
        lines = []
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == 'ready':
                break
            assert time.monotonic() < deadline, ''.join(lines)
        assert lines and lines[-1].strip() == 'ready', ''.join(lines)
        family = psutil.Process(proc.pid).children(recursive=True)
        if sig is not None:
            time.sleep(0.5)
            family = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(sig)
        start = time.monotonic()
        try:
            code = proc.wait(limit)
        except subprocess.TimeoutExpired:
            pytest.fail(f'the script was still running {limit} s after it ended ({case}, {sig})')
        took = time.monotonic() - start
        output = ''.join(lines) + proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    deadline = time.monotonic() + 5
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(family), f'left behind: {_alive(family)}\n{output[-3000:]}'
    leaked = _shm() - shm
    if leaked:  # (another test's entry may come and go meanwhile: look again)
        time.sleep(1)
        leaked &= _shm()
    assert not leaked, f'/dev/shm entries left behind: {sorted(leaked)}'
    return code, took, output


# on a GPU machine: LMDEPLOY_EXIT_TEST_DEVICE=cuda LMDEPLOY_EXIT_TEST_MODEL=<a model directory> (NCCL for tp=2)
DEVICE = os.environ.get('LMDEPLOY_EXIT_TEST_DEVICE', 'cpu')


@pytest.fixture(scope='module')
def model(request):
    return os.environ.get('LMDEPLOY_EXIT_TEST_MODEL') or request.getfixturevalue('tiny_model_factory')('llama')


@pytest.mark.parametrize('case', ['return', 'raise'])
def test_tp2_exits_when_the_script_ends(model, case):
    code, took, output = _run(model, case)
    if case == 'return':
        assert code == 0 and 'Traceback' not in output, output[-3000:]
    else:
        assert code == 1 and 'the user code failed' in output, output[-3000:]
    # closed before the interpreter's teardown: group destroyed (on NCCL its C++ destructor hung the exit),
    # engine and pipeline threads gone (a daemon thread stopped inside torch aborts the process)
    assert "at teardown: group destroyed threads []" in output, output[-3000:]


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM], ids=['sigint', 'sigterm'])
def test_tp2_exits_on_a_signal(model, sig):
    code, took, output = _run(model, 'signal', sig=sig)
    assert code in (-sig, 128 + sig, 1), output[-3000:]  # KeyboardInterrupt: 1 or -SIGINT
    if sig == signal.SIGINT:
        assert 'KeyboardInterrupt' in output, output[-3000:]
        assert "at teardown: group destroyed threads []" in output, output[-3000:]


def test_tp1_exits_on_an_exception_while_generating(model):
    """The engine's loop is stopped before the interpreter's teardown, not frozen inside a step (which ended
    the process with "terminate called without an active exception", exit 134)."""
    code, _, output = _run(model, 'busy_raise', tp=1)
    assert code == 1 and 'the user code failed' in output and 'terminate called' not in output, output[-3000:]
    assert "threads []" in output, output[-3000:]


@pytest.mark.parametrize('case,sig', [('return', None), ('signal', signal.SIGTERM)], ids=['return', 'sigterm'])
def test_tp2_engine_process_exits(model, case, sig):
    """The server's layout: the engine and rank 0 in a child process, rank 1 under it."""
    code, _, output = _run(model, case, engine_process=True, sig=sig)
    assert (code == 0) if sig is None else code == -sig, output[-3000:]


def test_tp2_ray_exits_when_the_script_ends(model):
    pytest.importorskip('ray')
    code, _, output = _run(model, 'return', backend='ray', limit=30)
    assert code == 0, output[-3000:]
