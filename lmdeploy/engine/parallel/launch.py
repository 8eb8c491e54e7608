"""Starting the ranks other than rank 0: as processes of this machine ('mp'),
or as Ray actors on the machines of a Ray cluster ('ray').

A launcher starts one worker per spec, says whether one is gone (and why),
and stops them: a clean stop waits for them to exit, then kills what is left."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import List, Optional

from .worker import WorkerSpec, write_spec

_WORKER = 'from lmdeploy.engine.parallel.worker import main; main()'
_EOF_GRACE_S = 2.0  # a worker whose pipe closed exits within its watch's poll; then it is killed


class ProcessLauncher:
    """One fresh interpreter per rank (nothing of the user's ``__main__`` re-runs in it), on this machine's
    device ``rank``; each exits with the process that started it: its stdin is a pipe from this process,
    held open until the stop, whose end of file the worker takes as the order to exit at once."""
    host = '127.0.0.1'

    def __init__(self, device):
        self.procs: List[subprocess.Popen] = []

    def rank0_device_index(self) -> Optional[int]:
        return 0

    def start(self, spec: WorkerSpec):
        spec.device_index = spec.rank
        proc = subprocess.Popen(worker_argv(_WORKER), stdin=subprocess.PIPE)
        self.procs.append(proc)
        write_spec(proc.stdin, spec)

    def gone(self) -> Optional[str]:
        for rank, proc in enumerate(self.procs, 1):
            code = proc.poll()
            if code is not None:
                return f'rank {rank} (pid {proc.pid}) exited with code {code}'
        return None

    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def stop(self, timeout: float):
        """Wait for the workers to exit (they were told to stop, or are gone); after ``timeout`` close their
        pipes (they exit at once), and kill what is still there a moment later."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            _wait(proc, deadline - time.monotonic())
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + _EOF_GRACE_S
        for proc in self.procs:
            if not _wait(proc, deadline - time.monotonic()):
                proc.kill()
                proc.wait()


def worker_argv(code: str) -> List[str]:
    """A fresh interpreter running ``code`` with this process's lmdeploy first on its path. ``python -c`` puts
    the working directory first: a worker started from a folder that holds another lmdeploy (a checkout, an
    older copy) would import that one, whose steps differ from rank 0's, and the ranks would wait on each
    other's collectives for ever."""
    import lmdeploy
    root = os.path.dirname(os.path.dirname(os.path.abspath(lmdeploy.__file__)))
    return [sys.executable, '-c', f'import sys; sys.path.insert(0, {root!r}); {code}']


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    try:
        proc.wait(max(0.0, timeout))
        return True
    except subprocess.TimeoutExpired:
        return False


class RayLauncher:
    """One Ray actor per rank, in a placement group whose first bundle (rank 0's device) is on this
    machine; the actors' devices are the ones Ray assigns them. Ray would make an actor's device the only one
    its process sees; where the device names the variable that does so, every rank keeps its node's devices in
    view instead and picks its own by index, as rank 0 does (on 2 GPUs, one-shot all-reduce through peer
    buffers and NCCL's peer-to-peer transport need the other rank's GPU visible)."""

    def __init__(self, device):
        try:
            import ray
            from ray.util.placement_group import placement_group
        except ImportError as e:
            raise ImportError("distributed_executor_backend='ray' needs the ray package: "
                              "pip install 'lmdeploy[ray]'") from e
        self._ray = ray
        if not ray.is_initialized():
            # RAY_ADDRESS (or a cluster started with `ray start` on this machine) is joined; else a local one starts
            ray.init(address=os.environ.get('RAY_ADDRESS'), ignore_reinit_error=True)
        self.host = ray.util.get_node_ip_address()
        self.resource = device.runtime.ray_resource
        self.visible_env = device.runtime.visible_devices_env if self.resource else None
        self.actors, self.refs = [], []
        self.pg = None
        self._placeholder = None
        self._placement_group = placement_group

    def reserve(self, world: int):
        unit = {'CPU': 1, self.resource: 1} if self.resource else {'CPU': 1}
        bundles = [dict(unit) for _ in range(world)]
        bundles[0][f'node:{self.host}'] = 0.001  # rank 0 is this process
        self.pg = self._placement_group(bundles, strategy='PACK')
        self._ray.get(self.pg.ready(), timeout=float(os.environ.get('LMDEPLOY_RAY_TIMEOUT', 120)))

    def _options(self, bundle: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        opts = {'num_cpus': 1, 'scheduling_strategy': PlacementGroupSchedulingStrategy(self.pg, bundle)}
        if self.resource == 'GPU':
            opts['num_gpus'] = 1
        elif self.resource:
            opts['resources'] = {self.resource: 1}
        if self.visible_env:
            opts['runtime_env'] = {'env_vars': {f'RAY_EXPERIMENTAL_NOSET_{self.visible_env}': '1'}}
        return opts

    def rank0_device_index(self) -> Optional[int]:
        """The device Ray set aside for rank 0 on this machine, held by a placeholder actor."""
        if not self.resource:
            return None
        self._placeholder = _actor_class(self._ray).options(**self._options(0)).remote()
        ids = self._ray.get(self._placeholder.device_ids.remote(self.resource))
        return local_device_index(ids[0], self.visible_env)

    def start(self, spec: WorkerSpec):
        spec.device_index = None  # the actor finds its own where Ray assigns it one (RankActor.run)
        actor = _actor_class(self._ray).options(**self._options(spec.rank)).remote()
        self.actors.append(actor)
        self.refs.append(actor.run.remote(spec, self.resource, self.visible_env))

    def gone(self) -> Optional[str]:
        ready, _ = self._ray.wait(self.refs, timeout=0)
        for ref in ready:
            rank = self.refs.index(ref) + 1
            try:
                self._ray.get(ref)
                why = 'stopped'
            except Exception as e:  # the actor died or its loop raised
                why = f'failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'
            return f'rank {rank} (Ray actor) {why}'
        return None

    def pids(self) -> List[int]:
        return []

    def stop(self, timeout: float):
        if not self._ray.is_initialized():  # ray.shutdown() ran first (its atexit handler): the actors went with it
            self.actors, self._placeholder, self.pg = [], None, None
            return
        if self.refs:
            self._ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout)
        for actor in self.actors + ([self._placeholder] if self._placeholder is not None else []):
            self._ray.kill(actor)
        self._placeholder = None
        self.actors = []  # self.refs stay: gone() keeps saying why the ranks are gone
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.pg)
            self.pg = None


_ACTOR = None


def _actor_class(ray):
    global _ACTOR
    if _ACTOR is None:

        class RankActor:

            def run(self, spec: WorkerSpec, resource: Optional[str], visible_env: Optional[str]):
                from lmdeploy.log import configure

                from .worker import serve
                configure(spec.log_level, f' (rank {spec.rank})')
                if resource:  # the device Ray assigned: the only one in view, or its place among the node's
                    ids = self.device_ids(resource)
                    spec.device_index = local_device_index(ids[0], visible_env) if visible_env else 0
                serve(spec)

            def device_ids(self, resource: str):
                return ray.get_runtime_context().get_accelerator_ids()[resource]

        _ACTOR = ray.remote(RankActor)
    return _ACTOR


def local_device_index(device_id, visible_env: Optional[str]) -> int:
    """The torch index of the device Ray calls ``device_id`` in a process that sees its node's devices: Ray names
    devices as the node lists them in ``visible_env`` where that is set (a raylet started with
    CUDA_VISIBLE_DEVICES=2,3 calls its devices '2' and '3'), by their index otherwise."""
    listed = [d.strip() for d in os.environ.get(visible_env or '', '').split(',') if d.strip()]
    return listed.index(str(device_id)) if str(device_id) in listed else int(device_id)


LAUNCHERS = {'mp': ProcessLauncher, 'ray': RayLauncher}
