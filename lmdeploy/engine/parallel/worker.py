"""A rank other than the first: builds its shard like rank 0 does, then runs
whatever rank 0 sends (channel.py) until told to stop."""
from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from lmdeploy.at_exit import run_bounded
from lmdeploy.messages import PytorchEngineConfig

from ..model_config import ModelConfig
from ..model_runner import StepMeta
from ..transfer import to_device
from . import channel
from .group import join_group, leave_group

logger = logging.getLogger('lmdeploy')

_LEAVE_TIMEOUT_S = 10.0  # destroying the process group (NCCL may wait on a peer that is gone)


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
    command_port: int = 0  # rank 0's command channel (channel.py), on ``host``


def serve(spec: WorkerSpec):
    from lmdeploy.devices import get_device

    from ..nn.parallel import set_tensor_parallel
    from ..rank import build_rank

    device = get_device(spec.config.device_type)
    if spec.device_index is not None:
        device.runtime.set_device_index(spec.device_index)
    commands = channel.Receiver(spec.host, spec.command_port, spec.rank)
    join_group(device.runtime.collective_backend, spec.host, spec.port, spec.rank, spec.world)
    try:
        set_tensor_parallel(spec.rank, spec.world)
        runner = build_rank(spec.model_path, spec.config, spec.model_config, device).runner
        _loop(runner, commands)
        runner.drop_recordings()
    finally:
        commands.close()
        run_bounded(leave_group, _LEAVE_TIMEOUT_S, 'leaving the tensor-parallel group')


@torch.inference_mode()
def _loop(runner, commands: channel.Receiver):
    hidden, dev = None, runner.torch_device
    while True:
        cmd, args, payload = commands.receive()
        if cmd == channel.GONE:
            return
        if cmd == channel.STOP:
            runner.runtime.synchronize()  # nothing of this rank's is left queued when the group goes
            return
        if cmd == channel.FORWARD:
            meta = StepMeta(*args[:len(StepMeta._fields)])
            ids, positions, ctx = runner.unpack_inputs(to_device(payload, dev), meta)
            if meta.n_prev:  # the tokens of the step in flight, which only rank 0's device holds
                ids = runner.runtime.broadcast(ids.contiguous())
            hidden = runner.run(ids, positions, ctx)
        elif cmd in (channel.LOGITS, channel.GREEDY):
            rows = payload if payload is not None else torch.empty(0, dtype=torch.int64)
            picked = hidden.index_select(0, to_device(rows, dev))
            if cmd == channel.LOGITS:
                runner.logits(picked)
            else:
                runner.greedy(picked)
        else:
            raise RuntimeError(f'unknown command {cmd} from rank 0')


def read_spec(fd: int) -> WorkerSpec:
    """The spec rank 0 writes on the worker's stdin: its length (8 bytes), then the pickle. Read to the byte,
    so that what follows on the pipe (nothing, then end of file) is the parent's liveness."""
    def read(n: int) -> bytes:
        data = b''
        while len(data) < n:
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise EOFError('the engine process closed the pipe before the worker spec was complete')
            data += chunk
        return data
    return pickle.loads(read(int.from_bytes(read(8), 'little')))


def write_spec(stream, spec: WorkerSpec):
    data = pickle.dumps(spec)
    stream.write(len(data).to_bytes(8, 'little') + data)
    stream.flush()


def _exit_with_parent(fd: int):
    """A worker never outlives the process that started it, even one killed without clean-up: the parent
    holds the other end of this pipe (stdin) for the worker's whole life, so the end of the file comes the
    moment the parent is gone or gives up on a clean stop. The parent pid is watched too (a child the parent
    forked could hold the pipe open)."""
    parent = os.getppid()

    def watch():
        while True:
            readable, _, _ = select.select([fd], [], [], 0.5)
            if (readable and not os.read(fd, 1)) or os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name='lmdeploy-parent-watch', daemon=True).start()


def main():
    """Entry of a worker process (launch.py): the spec arrives on stdin, which stays open while rank 0 lives.

    The process ends with ``os._exit``: once the group is left there is nothing to flush but logs, and the
    interpreter's own teardown (CUDA graphs, NCCL communicators destroyed by C++ destructors) is where a
    process that holds a device can hang."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle: it stops the workers
    code, rank = 1, '?'
    try:
        spec = read_spec(0)
        rank = spec.rank
        _exit_with_parent(0)
        from lmdeploy.log import configure
        configure(spec.log_level, f' (rank {rank})')
        serve(spec)
        code = 0
    except EOFError:
        pass  # rank 0 went away before sending the spec
    except Exception:
        logger.exception('tensor-parallel rank %s failed', rank)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
