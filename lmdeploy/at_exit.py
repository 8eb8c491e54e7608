"""Whatever lmdeploy opened (pipelines, engines, engine processes) is closed at interpreter exit,
``close()`` called or not.

Why here and not in ``__del__``: Python ends a program by joining its non-daemon threads, running the
atexit handlers, and only then tearing modules down, when daemon threads (an engine's loop, a pipeline's
event loop) are stopped wherever they are. An engine closed that late waits for a thread that can no
longer run; one never closed leaves its tensor-parallel process group to C++ destructors (NCCL's
watchdog) and its workers waiting for a command, so the program hangs, or aborts ("terminate called
without an active exception") when a daemon thread is stopped inside a torch call. From an atexit
handler, the threads still run and ``close()`` does what it does in a program that calls it.

The handler is registered again each time something opens, so it runs before the atexit handlers of
libraries imported meanwhile (``ray.shutdown`` among them) and finds what it closes still working.
"""
from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Callable, Dict

logger = logging.getLogger('lmdeploy')

_open: Dict[int, weakref.ref] = {}  # id -> weak reference, oldest first
_lock = threading.Lock()


def close_at_exit(obj) -> None:
    """Call ``obj.close()`` at interpreter exit if ``obj`` is still alive then (newest first)."""
    key = id(obj)

    def forget(_ref, key=key):
        with _lock:
            if _open.get(key) is _ref:
                del _open[key]

    with _lock:
        _open[key] = weakref.ref(obj, forget)
    atexit.unregister(_close_all)
    atexit.register(_close_all)


def _close_all():
    with _lock:
        refs = list(_open.values())
        _open.clear()
    for ref in reversed(refs):  # a pipeline before the engine it made
        obj = ref()
        if obj is None:
            continue
        try:
            obj.close()
        except Exception:  # one failure must not keep the others open
            logger.exception('closing %s at exit failed', type(obj).__name__)


def run_bounded(fn: Callable[[], None], timeout: float, what: str) -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout`` s for it (a step of a shutdown that may
    block on a peer, e.g. destroying an NCCL group); False (and a warning) when it did not finish."""
    error = []

    def run():
        try:
            fn()
        except Exception as e:
            error.append(e)

    t = threading.Thread(target=run, name=f'lmdeploy-{what}', daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        logger.warning('%s did not finish in %.0f s; going on without it', what, timeout)
        return False
    if error:
        logger.warning('%s failed: %s: %s', what, type(error[0]).__name__, error[0])
        return False
    return True
