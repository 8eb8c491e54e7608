"""A rank other than the first: builds its shard like rank 0 does, then runs
whatever rank 0 broadcasts (channel.py) until told to stop."""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from lmdeploy.messages import PytorchEngineConfig

from ..model_config import ModelConfig
from ..model_runner import StepMeta
from . import channel
from .group import join_group, leave_group

logger = logging.getLogger('lmdeploy')


@dataclass
class WorkerSpec:
    model_path: str
    config: PytorchEngineConfig
    model_config: ModelConfig
    rank: int
    world: int
    host: str  # rank 0's rendezvous
    port: int
    device_index: Optional[int]  # this machine's device to use (None: the one the process already has)
    log_level: int = logging.WARNING


def serve(spec: WorkerSpec):
    from lmdeploy.devices import get_device

    from ..nn.parallel import set_tensor_parallel
    from ..rank import build_rank

    device = get_device(spec.config.device_type)
    if spec.device_index is not None:
        device.set_device_index(spec.device_index)
    join_group(device.collective_backend, spec.host, spec.port, spec.rank, spec.world)
    try:
        set_tensor_parallel(spec.rank, spec.world)
        runner = build_rank(spec.model_path, spec.config, spec.model_config, device).runner
        _loop(runner, channel.Channel(device))
    finally:
        leave_group()


@torch.inference_mode()
def _loop(runner, chan: channel.Channel):
    hidden = None
    while True:
        cmd, args, payload = chan.receive()
        if cmd == channel.STOP:
            return
        if cmd == channel.FORWARD:
            meta = StepMeta(*args[:len(StepMeta._fields)])
            n = payload.numel() - meta.num_tokens
            ids, positions, ctx = runner.unpack_inputs(payload[:n], meta)
            hidden = runner.run(payload[n:], positions, ctx)
        elif cmd == channel.LOGITS:
            runner.logits(hidden.index_select(0, payload))
        else:
            raise RuntimeError(f'unknown command {cmd} from rank 0')


def _exit_with_parent():
    """A worker never outlives the process that started it (even one killed without cleanup)."""
    parent = os.getppid()

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name='lmdeploy-parent-watch', daemon=True).start()


def main():
    """Entry of a worker process (launch.py): the spec arrives pickled on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle: it stops the workers
    _exit_with_parent()
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    from lmdeploy.log import configure
    configure(spec.log_level, f' (rank {spec.rank})')
    try:
        serve(spec)
    except Exception:
        logger.exception('tensor-parallel rank %d failed', spec.rank)
        sys.exit(1)
