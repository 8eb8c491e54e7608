"""Work a module-scoped fixture needs, begun in the background once collection is done.

The CUDA compile tests (tests/test_cuda_compile.py, tests/test_csrc_build.py) and the KV quantization's
perplexity (tests/test_kv_quant.py) take about 18 CPU minutes of single-threaded work, while most other
tests keep one core of a 2-core runner busy and leave the other idle. That work therefore starts when
collection finishes, in subprocesses at the lowest priority (they take only CPU that the tests leave
idle), and the tests it serves run last (conftest.py), so it has the whole session; what is left when
those tests come is raised back to normal priority and runs on every core. A test alone, or a run where
nothing started the work, begins it when its fixture asks: no test depends on another.
"""
from __future__ import annotations

import os
from typing import Callable, List, Optional


def lower_priority(pid: int = 0) -> None:
    """Yield the CPU to the tests: called by the parent on a background subprocess just started (what
    it starts later inherits it). Linux's SCHED_IDLE runs it only on a core nothing else wants (a test's
    thread that wakes takes the core at once, which matters to torch's thread pools); elsewhere nice 19
    (this process only)."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    if pid == 0:
        try:
            os.nice(19)
        except (AttributeError, OSError):
            pass


def restore_priority(pids) -> None:
    """Back to the normal policy, for ``pids`` and every process under them (each thread): the tests
    now wait for their work. Best effort: leaving SCHED_IDLE needs root or a permitting RLIMIT_NICE; on an
    otherwise idle machine it changes nothing anyway."""
    if not hasattr(os, 'sched_setscheduler') or not os.path.isdir('/proc'):
        return
    children = {}
    for entry in os.listdir('/proc'):
        try:
            with open(f'/proc/{entry}/stat') as f:
                ppid = int(f.read().rsplit(')', 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    todo = list(pids)
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            tids = [int(t) for t in os.listdir(f'/proc/{pid}/task')]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass


class Background:
    """``serves(item)``: whether a collected test needs the work; ``begin(items)``: start it for those
    tests, returning a job with ``result(timeout)``, ``cancel()`` and ``pids()`` (its processes), or None
    (nothing to do here, e.g. a tool is missing and the tests skip)."""
    instances: List['Background'] = []

    def __init__(self, serves: Callable, begin: Callable):
        self.serves, self.begin = serves, begin
        self.job, self.started = None, False
        Background.instances.append(self)

    def start(self, items, even_unused: bool = False) -> None:
        """Begin the work for those of ``items`` it serves (none: nothing begins, unless ``even_unused``)."""
        mine = [item for item in items if self.serves(item)]
        if not self.started and (mine or even_unused):
            self.started = True
            self.job = self.begin(mine)

    def result(self, session, timeout: float = 1800):
        """The work's result for this session's tests, begun now if it was not yet."""
        self.start(session.items, even_unused=True)
        if self.job is None:
            return None
        restore_priority(self.job.pids())
        return self.job.result(timeout)

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancel()
        self.job, self.started = None, False


def served(item) -> Optional[Background]:
    return next((bg for bg in Background.instances if bg.serves(item)), None)
