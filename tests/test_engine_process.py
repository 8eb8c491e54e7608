"""The engine in its own process (lmdeploy.engine.process): same tokens as
in-process, errors come back, and no process outlives its owner."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from engine_utils import assert_engine_clean, generate_all, greedy, submit

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.process import EngineProcess, EngineProcessError
from lmdeploy.engine.sequence import SamplingParams
from lmdeploy.messages import PytorchEngineConfig


def _config(**kw):
    return PytorchEngineConfig(device_type='cpu', block_size=4, session_len=256, max_batch_size=8, **kw)


def _prompts(n, seed=0):
    import random
    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope='module')
def llama(tiny_model_factory):
    return tiny_model_factory('llama')


@pytest.fixture(scope='module')
def proc(llama):
    eng = EngineProcess(llama, _config(num_gpu_blocks=64))
    yield eng
    eng.close()


def test_same_tokens_as_in_process(llama, proc):
    prompts = _prompts(12)
    params = greedy(9)
    local = Engine(llama, _config(num_gpu_blocks=64))
    try:
        want = generate_all(local, prompts, params)
    finally:
        local.close()
    assert generate_all(proc, prompts, params) == want
    sampled = SamplingParams(max_new_tokens=7, greedy=False, temperature=0.9, top_p=0.8, seed=3, logprobs=2)
    a, b = submit(proc, prompts[0], sampled).wait(), submit(proc, prompts[0], sampled).wait()
    assert a.token_ids == b.token_ids and len(a.token_ids) == 7
    assert all(len(lp) >= 1 for o in a.outputs for lp in (o.logprobs or []))  # extras travel as objects
    assert_engine_clean(proc)


def test_refusals_cancel_and_stats_cross_the_channel(proc):
    too_long = submit(proc, list(range(5, 300)), greedy(4)).wait()
    assert too_long.final.finish_reason == 'length' and 'session_len' in too_long.final.error
    empty = submit(proc, [], greedy(4)).wait()
    assert empty.final.finish_reason == 'error' and 'empty' in empty.final.error
    long = submit(proc, [7, 8, 9], greedy(200), session_id=4242)
    while not long.token_ids:
        time.sleep(0.01)
    proc.cancel(4242)
    assert long.wait().final.finish_reason == 'abort'
    # a request kept as an interactive session, then ended
    chat = submit(proc, [5, 6, 7], greedy(3), session_id=77, interactive=True).wait()
    assert len(chat.token_ids) == 3 and proc.stats().num_idle_sessions == 1
    proc.end_session(77)
    assert_engine_clean(proc)
    s = proc.stats()
    assert s.num_blocks == 64 and s.num_generated_tokens > 0
    assert proc.session_len == 256 and proc.model_config.vocab_size > 0


def test_unpicklable_request_fails_with_a_reason(proc):
    col = submit(proc, [5, 6], SamplingParams(max_new_tokens=2, logits_processors=[lambda ids, x: x])).wait()
    assert col.final.finish_reason == 'error' and 'picklable' in col.final.error
    assert proc.is_alive()


def test_start_up_failure_is_raised_in_the_parent(tmp_path, llama):
    with pytest.raises(Exception, match='config.json|No such file|not found|does not exist'):
        EngineProcess(str(tmp_path / 'missing'), _config())
    with pytest.raises(ValueError, match='tp=3'):  # the child's own exception: 2 KV heads do not go over 3 ranks
        EngineProcess(llama, _config(tp=3))


def test_dead_engine_fails_requests_instead_of_hanging(llama):
    eng = EngineProcess(llama, PytorchEngineConfig(device_type='cpu', block_size=16, session_len=8192))
    try:
        running = submit(eng, [5, 6, 7], greedy(8000))  # seconds of work: still running when killed
        while not running.token_ids:
            time.sleep(0.01)
        os.kill(eng.pid, signal.SIGKILL)
        out = running.wait(30).final
        assert out.finish_reason == 'error' and 'engine process stopped unexpectedly' in out.error
        deadline = time.monotonic() + 10
        while eng.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not eng.is_alive()
        late = submit(eng, [5, 6], greedy(3)).wait(5)
        assert late.final.finish_reason == 'error' and 'stopped unexpectedly' in late.final.error
        with pytest.raises(EngineProcessError):
            eng.stats()
    finally:
        eng.close()


def test_close_and_a_killed_owner_leave_no_process(llama, tmp_path):
    eng = EngineProcess(llama, _config(num_gpu_blocks=32))
    pid = eng.pid
    running = submit(eng, [5, 6, 7], greedy(200))
    eng.close()
    assert running.wait(10).final.finish_reason == 'abort'
    assert _gone(pid, 5)
    # the owner dies without closing anything: the engine process notices and exits
    script = tmp_path / 'owner.py'
    script.write_text(textwrap.dedent(f"""
        import os, sys
        from lmdeploy.engine.process import EngineProcess
        from lmdeploy.messages import PytorchEngineConfig
        eng = EngineProcess({llama!r}, PytorchEngineConfig(device_type='cpu', block_size=4, session_len=64,
                                                           num_gpu_blocks=16))
        print(eng.pid, flush=True)
        os.kill(os.getpid(), 9)
    """))
    owner = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert owner.returncode == -9, owner.stderr
    child = int(owner.stdout.split()[0])
    assert _gone(child, 15), 'the engine process outlived its owner'
