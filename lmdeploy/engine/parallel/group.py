"""Forming the ranks' process group.

Rank 0 hosts the rendezvous store and waits for every other rank to check
in, watching that they are still alive (a worker that fails while starting
would otherwise leave rank 0 waiting for the store's whole timeout)."""
from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from typing import Callable, Optional

# a collective that waits longer than this fails (a rank that hangs); LMDEPLOY_TP_TIMEOUT overrides
DEFAULT_TIMEOUT_S = 600.0


def timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get('LMDEPLOY_TP_TIMEOUT', DEFAULT_TIMEOUT_S)))


def free_port(host: str = '') -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _store(host: str, port: int, world: int, is_master: bool):
    import torch.distributed as dist
    return dist.TCPStore(host, port, world, is_master=is_master, timeout=timeout(), wait_for_workers=False)


_hook = []  # sys.excepthook before joining (torch wraps it to prefix "[rankN]" to tracebacks)


def _init(backend: str, store, rank: int, world: int):
    import torch.distributed as dist
    _hook.append(sys.excepthook)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout())


def host_group(backend: str, host: str, port: int, world: int, check_workers: Callable[[], Optional[str]],
               start_timeout: float):
    """Rank 0: serve the rendezvous, wait for the others (``check_workers`` returns why one is gone, or
    None), then join the group."""
    store = _store(host, port, world, True)
    keys = [f'joined/{r}' for r in range(1, world)]
    deadline = time.monotonic() + start_timeout
    while not store.check(keys):
        gone = check_workers()
        if gone:
            raise RuntimeError(f'tensor-parallel start-up failed: {gone}')
        if time.monotonic() > deadline:
            raise RuntimeError(f'tensor-parallel start-up: not every rank joined within {start_timeout:.0f} s')
        time.sleep(0.05)
    _init(backend, store, 0, world)


def join_group(backend: str, host: str, port: int, rank: int, world: int):
    """Ranks 1..world-1: check in at rank 0's store and join the group."""
    store = _store(host, port, world, False)
    store.set(f'joined/{rank}', '1')
    _init(backend, store, rank, world)


def leave_group():
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    if _hook:
        sys.excepthook = _hook.pop()
