"""Work a module-scoped fixture needs, begun in the background once collection is done.

The CUDA compile tests (tests/test_cuda_compile.py, tests/test_csrc_build.py), the KV quantization's
perplexity (tests/test_kv_quant.py) and the Docker recipe's install in a fresh venv
(tests/test_docker_recipe.py) take about 20 CPU minutes of single-threaded work, while most other
tests keep one core of a 2-core runner busy and leave the other idle. That work therefore starts when
collection finishes, in subprocesses at the lowest priority (they take only CPU that the tests leave
idle), and the tests it serves run last (conftest.py), so it has the whole session; what is left when
those tests come is raised back to normal priority and runs on every core. A test alone, or a run where
nothing started the work, begins it when its fixture asks: no test depends on another.

Each background subprocess runs in a session of its own (``BACKGROUND_POPEN``), whose autogroup
lower_priority() sets to nice 19. Linux's autogroups (sched_autogroup_enabled, on by default) share the
CPU between sessions first and only then between the tasks of a session, so SCHED_IDLE ranks a task only
against the others of its session: a background process in a session of its own at the autogroup's
default nice 0 takes half of a contended core from the whole test session (a 2-thread torch test then
ran several times slower), and one left in pytest's session still takes half of it from a test's child
in a session of its own (pexpect's terminal sessions, the servers of tests/test_proxy.py).
"""
from __future__ import annotations

import errno
import os
import time
from typing import Callable, List, Optional


# Popen's keyword arguments for a background subprocess: a session (so an autogroup) of its own, which
# lower_priority() then sets to nice 19 (see above); killing its process group takes its children too.
BACKGROUND_POPEN = dict(start_new_session=True)


def _set_autogroup_nice(pid: int, nice: int) -> None:
    """The nice value of the autogroup of ``pid``'s session, where ``pid`` leads that session (one started
    with BACKGROUND_POPEN); best effort: without autogroups (or /proc) nothing to do. Raising it, and
    lowering it back to 0, needs no privilege; without CAP_SYS_ADMIN the kernel takes one change in 0.1 s
    (EAGAIN before that), so a refused one is tried again."""
    try:
        if os.getsid(pid) != pid:
            return  # not a session of its own: its autogroup is its parent's (pytest's, say)
    except (AttributeError, OSError):
        return
    for _ in range(20):
        try:
            with open(f'/proc/{pid}/autogroup', 'w') as f:
                f.write(str(nice))
            return
        except OSError as e:
            if e.errno != errno.EAGAIN:
                return
        time.sleep(0.11)


def lower_priority(pid: int = 0) -> None:
    """Yield the CPU to the tests: called by the parent on a background subprocess just started (what
    it starts later inherits it). Linux's SCHED_IDLE runs it only on a core nothing else wants (a test's
    thread that wakes takes the core at once, which matters to torch's thread pools), and a process
    started with BACKGROUND_POPEN gets its session's autogroup set to nice 19 (the CPU is shared between
    autogroups before SCHED_IDLE is looked at); elsewhere nice 19 (this process only)."""
    if pid:
        _set_autogroup_nice(pid, 19)
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
    """Back to the normal policy, for ``pids`` and every process under them (each thread), and their
    sessions' autogroups back to nice 0: the tests now wait for their work. Best effort: leaving
    SCHED_IDLE needs root or a permitting RLIMIT_NICE; on an otherwise idle machine it changes nothing
    anyway."""
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
        _set_autogroup_nice(pid, 0)
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
