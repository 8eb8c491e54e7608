"""The engine in a process of its own, behind the same surface as :class:`Engine`.

Why: in one process the HTTP server's thread (uvicorn writes, SSE JSON,
detokenization) and the engine's step loop share one interpreter lock, so
every step waits for the server now and then. Here the child runs the
engine alone; the parent (the API server, or a pipeline that asks for it)
talks to it over one socket pair:

* parent -> child: ``('add', rid, EngineRequest fields)``, ``('cancel', sid)``,
  ``('end', sid)``, ``('call', cid, method, args)``, ``('stop',)``
* child -> parent: ``('out', [(rid, output), ...])`` once per engine loop
  iteration (one message per step, not per token), ``('reply', cid, ok,
  value)``, and at start-up ``('ready', EngineInfo)`` or ``('fatal', exception)``.

Outputs that carry only token ids travel as a plain tuple (a few times
cheaper to pickle than the dataclass). The child is a fresh interpreter
(``python -c``; nothing of the parent's ``__main__`` is re-run), ignores
SIGINT and SIGTERM (the parent decides when to stop, after draining), and
exits when the socket closes, so it never outlives its parent. A child that dies fails
every request in flight with an error that says so.
"""
from __future__ import annotations

import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import Callable, Dict, Optional

from lmdeploy.at_exit import close_at_exit

from .protocol import EngineInfo
from .sequence import EngineOutput

logger = logging.getLogger('lmdeploy')

_STOP_TIMEOUT = 30.0  # seconds the child gets to finish a stop before it is killed


def _pack(out: EngineOutput):
    """An output as the wire carries it: a tuple when it holds nothing but ids."""
    if (out.logprobs is None and out.logits is None and out.last_hidden_state is None
            and out.prompt_loss is None and out.prompt_logprobs is None and out.stop_token is None):
        return (out.new_token_ids, out.finished, out.finish_reason, out.num_prompt_tokens, out.error, out.refused)
    return out


def _unpack(item) -> EngineOutput:
    if isinstance(item, tuple):
        ids, finished, reason, num_prompt, error, refused = item
        return EngineOutput(ids, finished, reason, num_prompt, error=error, refused=refused)
    return item


class EngineProcessError(RuntimeError):
    """The engine process could not start, or stopped."""


class EngineProcess:
    """:class:`Engine`'s surface as the frontend uses it (:class:`~lmdeploy.engine.protocol.EngineLike`:
    submit, cancel, end_session, stats, wait_idle, check_invariants, is_alive, close, and the sizes),
    with the engine running in a child process."""

    def __init__(self, model_path: str, config=None, model_config=None, start_timeout: Optional[float] = None):
        from lmdeploy.messages import PytorchEngineConfig
        self.config = config or PytorchEngineConfig()
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        env.setdefault('PYTHONUNBUFFERED', '1')
        # the child imports this very lmdeploy, wherever the parent found it (a path added at run time too)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env['PYTHONPATH'] = os.pathsep.join([root] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
        code = 'import sys; from lmdeploy.engine.process import child_entry; child_entry(int(sys.argv[1]))'
        self._proc = subprocess.Popen([sys.executable, '-c', code, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                      env=env)
        theirs.close()
        self._conn = Connection(mine.detach())
        self._send_lock = threading.Lock()
        self._callbacks: Dict[int, Callable[[EngineOutput], None]] = {}
        self._replies: Dict[int, list] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: Optional[str] = None  # why the child is gone
        self._closing = False
        try:
            self._send(('init', model_path, self.config, model_config, logging.getLogger('lmdeploy').level))
            kind, info = self._wait_ready(start_timeout)
        except BaseException:
            self._kill()
            raise
        if kind == 'fatal':
            self._proc.wait()
            raise info
        # the sizes EngineLike promises, as the child's engine has them
        self.model_config = info.model_config
        self.session_len: int = info.session_len
        self.num_blocks: int = info.num_blocks
        self.block_size: int = info.block_size
        self.max_batch_size: int = info.max_batch_size
        self.quant_policy: int = info.quant_policy
        self.device_name: str = info.device_name
        self.dtype = info.dtype
        self._reader = threading.Thread(target=self._read, name='lmdeploy-engine-reader', daemon=True)
        self._reader.start()
        # the child goes when this object does, or at interpreter exit at the latest
        self._finalizer = weakref.finalize(self, EngineProcess._shutdown, self._proc, self._conn, self._send_lock)
        close_at_exit(self)  # (before the atexit handlers of what was imported since)

    # --------------------------------------------------------------- start-up
    def _wait_ready(self, timeout: Optional[float]):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(0.2):
            code = self._proc.poll()
            if code is not None:
                raise EngineProcessError(f'the engine process exited with code {code} before it was ready')
            if deadline is not None and time.monotonic() > deadline:
                raise EngineProcessError(f'the engine process was not ready after {timeout} s')
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait()
            raise EngineProcessError(f'the engine process exited with code {code} before it was ready') from None

    # ------------------------------------------------------------------ wire
    def _send(self, msg):
        self._send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_bytes(self, data: bytes):
        with self._send_lock:
            self._conn.send_bytes(data)

    def _read(self):
        conn = self._conn
        try:
            while True:
                msg = pickle.loads(conn.recv_bytes())
                kind = msg[0]
                if kind == 'out':
                    for rid, item in msg[1]:
                        out = _unpack(item)
                        with self._lock:
                            cb = self._callbacks.pop(rid) if out.finished else self._callbacks.get(rid)
                        if cb is not None:
                            cb(out)
                elif kind == 'dead':  # the engine cannot run steps any more (e.g. it lost a tensor-parallel rank)
                    logger.error('the engine stopped: %s', msg[1])
                    with self._lock:
                        self._dead = msg[1]
                elif kind == 'reply':
                    _, cid, ok, value = msg
                    with self._lock:
                        slot = self._replies.get(cid)
                    if slot is not None:
                        slot[1:] = [ok, value]
                        slot[0].set()
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception('reading from the engine process failed')
        self._on_child_gone()

    def _on_child_gone(self):
        code = self._proc.poll()
        if code is None and not self._closing:
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
        why = ('the engine is shutting down' if self._closing else
               f'the engine process stopped unexpectedly (exit code {code})')
        if not self._closing:
            logger.error(why)
        with self._lock:
            self._dead = why
            callbacks, self._callbacks = self._callbacks, {}
            replies, self._replies = self._replies, {}
        for cb in callbacks.values():
            cb(EngineOutput([], True, 'abort' if self._closing else 'error', error=why))
        for slot in replies.values():
            slot[1:] = [False, EngineProcessError(why)]
            slot[0].set()

    def _call(self, method: str, *args, timeout: Optional[float] = None):
        done = threading.Event()
        slot = [done, False, None]
        cid = next(self._ids)
        with self._lock:
            if self._dead is not None:
                raise EngineProcessError(self._dead)
            self._replies[cid] = slot
        try:
            self._send(('call', cid, method, args))
            if not done.wait(timeout):
                raise TimeoutError(f'the engine process did not answer {method}() in {timeout} s')
        finally:
            with self._lock:
                self._replies.pop(cid, None)
        _, ok, value = slot
        if not ok:
            raise value
        return value

    # ------------------------------------------------------------ Engine API
    def submit(self, req):
        rid = next(self._ids)
        try:
            msg = pickle.dumps(('add', rid, req.session_id, req.token_ids, req.params, req.interactive, req.stream),
                               protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # e.g. a logits processor that is a lambda
            req.on_output(EngineOutput([], True, 'error', refused=True, error=(
                f'the request cannot be sent to the engine process ({type(e).__name__}: {e}); logits '
                'processors must be picklable there, or run the engine in-process (engine_process=False)')))
            return
        with self._lock:
            dead = self._dead
            if dead is None:
                self._callbacks[rid] = req.on_output
        if dead is not None:
            req.on_output(EngineOutput([], True, 'error', error=dead))
            return
        try:
            self._send_bytes(msg)
        except OSError:
            pass  # the reader fails the request once it sees the child gone

    def cancel(self, session_id: int):
        self._send_quietly(('cancel', session_id))

    def end_session(self, session_id: int):
        self._send_quietly(('end', session_id))

    def _send_quietly(self, msg):
        try:
            self._send(msg)
        except OSError:
            pass

    def stats(self):
        return self._call('stats', timeout=60)

    def check_invariants(self):
        return self._call('check_invariants', timeout=60)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        return self._call('wait_idle', timeout, timeout=timeout + 30)

    def is_alive(self) -> bool:
        return self._dead is None and not self._closing and self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self):
        """Stop the engine (running requests end as aborted) and wait for the child."""
        if self._closing:
            return
        self._closing = True
        self._finalizer()
        self._reader.join(timeout=10)

    def _kill(self):
        self._closing = True
        EngineProcess._shutdown(self._proc, self._conn, self._send_lock, timeout=0)

    @staticmethod
    def _shutdown(proc: subprocess.Popen, conn: Connection, send_lock, timeout: float = _STOP_TIMEOUT):
        if proc.poll() is None and timeout:
            try:
                with send_lock:
                    conn.send_bytes(pickle.dumps(('stop', )))
                proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        try:
            conn.close()
        except OSError:
            pass


# ---------------------------------------------------------------- the child
def child_entry(fd: int):
    """The child's whole life: ``child_main``, then ``os._exit``. The engine is closed by then (its ranks
    stopped, its group left); the interpreter's own teardown would only add C++ destructors (CUDA graphs,
    NCCL communicators), which is where a process that holds a device can hang."""
    code = 1
    try:
        code = child_main(fd)
    except BaseException:  # noqa: B902 - said here, as the interpreter would have
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def child_main(fd: int) -> int:
    """The engine process: build the engine, then relay requests and outputs until stopped or orphaned."""
    # Ctrl-C and SIGTERM sent to the whole group are the parent's to handle: it drains its requests, then
    # stops this process (which also exits when the parent is gone: the socket closes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        _, model_path, config, model_config, log_level = conn.recv()
    except (EOFError, OSError):
        return 0
    from lmdeploy.log import configure
    log = configure(log_level, ' (engine)')
    send_lock = threading.Lock()
    outbox: list = []  # (rid, packed output), appended and flushed on the engine thread only

    def send(msg):
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with send_lock:
            conn.send_bytes(data)

    def flush():
        if outbox:
            batch = outbox[:]
            outbox.clear()
            try:
                send(('out', batch))
            except OSError:
                pass  # the parent is gone; the main thread sees it and stops

    try:
        from .engine import Engine
        engine = Engine(model_path, config, model_config, on_loop=flush)
    except BaseException as e:  # noqa: B902 - every start-up failure goes back to the parent
        log.debug('engine start-up failed', exc_info=True)
        try:
            pickle.dumps(e)
        except Exception:
            e = EngineProcessError(f'{type(e).__name__}: {e}')
        try:
            send(('fatal', e))
        except OSError:
            pass  # the parent is gone
        return 1
    try:
        send(('ready', EngineInfo.of(engine)))
    except OSError:  # the parent went away while the model loaded
        engine.close()
        return 0
    threading.Thread(target=_report_death, args=(engine, send), name='lmdeploy-engine-watch', daemon=True).start()
    _relay(conn, engine, outbox, send)
    engine.close()
    flush()
    return 0


def _report_death(engine, send):
    """Tell the parent once the engine stops running steps on its own (not closed), so that it refuses new
    requests instead of handing them to an engine that fails each one."""
    while engine.is_alive():
        time.sleep(0.5)
    why = engine.why_stopped()
    if why:
        try:
            send(('dead', why))
        except OSError:
            pass


def _relay(conn: Connection, engine, outbox: list, send):
    from .engine import EngineRequest

    def reply(cid, method, args):
        try:
            send(('reply', cid, True, getattr(engine, method)(*args)))
        except Exception as e:
            try:
                send(('reply', cid, False, e))
            except Exception:
                send(('reply', cid, False, EngineProcessError(f'{type(e).__name__}: {e}')))

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone: stop rather than linger as an orphan
        kind = msg[0]
        if kind == 'add':
            _, rid, session_id, ids, params, interactive, stream = msg

            def on_output(out, rid=rid):
                outbox.append((rid, _pack(out)))
            engine.submit(EngineRequest(session_id, ids, params, on_output, interactive=interactive, stream=stream))
        elif kind == 'cancel':
            engine.cancel(msg[1])
        elif kind == 'end':
            engine.end_session(msg[1])
        elif kind == 'call':
            _, cid, method, args = msg
            if method not in ('stats', 'check_invariants', 'wait_idle'):
                send(('reply', cid, False, AttributeError(method)))
            else:  # off this thread: wait_idle blocks, and requests keep coming meanwhile
                threading.Thread(target=reply, args=(cid, method, args), daemon=True).start()
        elif kind == 'stop':
            return
