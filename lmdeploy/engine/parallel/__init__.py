"""Tensor parallelism (tp > 1): rank 0 is the engine's own process; the other
ranks are workers (worker.py) started by a launcher (launch.py: processes of
this machine, or Ray actors); rank 0 drives them (driver.py) over the
host (channel.py) and the device's process group (group.py). The model's layers hold their
rank's shard (nn/parallel.py)."""
from __future__ import annotations

import logging
from typing import Optional

from lmdeploy.at_exit import run_bounded
from lmdeploy.messages import PytorchEngineConfig

from ..model_config import ModelConfig
from ..nn.parallel import check_splits, set_tensor_parallel
from .channel import Listener
from .group import free_port, host_group, leave_group
from .launch import LAUNCHERS
from .worker import WorkerSpec

logger = logging.getLogger('lmdeploy')

_START_TIMEOUT_S = 600.0  # for every rank to check in (they import torch and reach the rendezvous)
_STOP_TIMEOUT_S = 10.0


class Workers:
    """The ranks other than this process's, from start to stop."""

    def __init__(self, launcher, world: int):
        self.launcher = launcher
        self.world = world
        self._driver = None
        self._closed = False
        self._failed: Optional[str] = None
        self.commands = None  # rank 0's end of the command channel (channel.py), once every rank connected

    def error(self) -> Optional[str]:
        """Why a rank is gone, or None while all run."""
        if self._failed:
            return self._failed
        return 'the engine was closed' if self._closed else self.launcher.gone()

    def fail(self, why: str):
        """The ranks cannot go on together: stop them now."""
        self._failed = why
        self.launcher.stop(0)

    def pids(self):
        return self.launcher.pids()

    def driver(self, runner):
        from .driver import ParallelRunner
        self._driver = ParallelRunner(runner, self)
        return self._driver

    def close(self):
        """Stop the ranks (call once the engine runs no more steps): tell them to stop, leave the group as
        they do (an NCCL group left to C++ destructors at interpreter exit can hang it), wait for them to
        exit, kill what is left. Every step is bounded: a rank that hangs costs seconds, not the exit."""
        if self._closed:
            return
        if self._driver is not None:
            run_bounded(self._driver.stop, _STOP_TIMEOUT_S, 'telling the tensor-parallel ranks to stop')
        self._closed = True
        run_bounded(leave_group, _STOP_TIMEOUT_S, 'leaving the tensor-parallel group')
        self.launcher.stop(_STOP_TIMEOUT_S)
        if self.commands is not None:
            self.commands.close()
        set_tensor_parallel(0, 1)


def start_workers(model_path: str, config: PytorchEngineConfig, model_config: ModelConfig, device) -> Workers:
    """Start ranks 1..tp-1 and form the group with them; this process becomes rank 0."""
    world = config.tp
    check_splits(model_config.num_heads, model_config.num_kv_heads, world)
    backend = config.distributed_executor_backend or 'mp'
    if backend not in LAUNCHERS:
        raise ValueError(f'distributed_executor_backend must be one of {sorted(LAUNCHERS)}, got {backend!r}')
    launcher = LAUNCHERS[backend](device)
    workers = Workers(launcher, world)
    listener = None
    try:
        if hasattr(launcher, 'reserve'):
            launcher.reserve(world)
        index = launcher.rank0_device_index()
        if index is not None:
            device.runtime.set_device_index(index)
        port, listener = free_port(), Listener(launcher.host)
        for rank in range(1, world):
            launcher.start(WorkerSpec(model_path, config, model_config, rank, world, launcher.host, port, None,
                                      logging.getLogger('lmdeploy').getEffectiveLevel(), listener.port))
        host_group(device.runtime.collective_backend, launcher.host, port, world, launcher.gone, _START_TIMEOUT_S)
        workers.commands = listener.accept(world, _START_TIMEOUT_S, launcher.gone)
        set_tensor_parallel(0, world)
    except BaseException:
        if listener is not None:
            listener.close()
        workers.close()
        raise
    logger.info('tensor parallelism: %d ranks (%s, %s)', world, backend, device.runtime.collective_backend)
    return workers
