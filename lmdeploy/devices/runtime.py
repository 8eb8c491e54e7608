"""The runtime services of a device, apart from its kernels (interface.py's :class:`DeviceOps`).

A device is a pair: its ops (the kernels the models call) and a :class:`DeviceRuntime` (what the engine
asks of the device around them: identity and availability, memory, synchronisation, copies to the host,
timing, graph capture, process groups, and the :class:`ExecutionPlan`). The ops name their runtime class
(``DeviceOps.runtime_class``) and hold its instance (``ops.runtime``), so the registry, ``get_device`` and
entry points are unchanged: a device is still registered as its ops class.

A device may still be written as ONE class (a plugin written before the split, or a test's emulation): the
services its ops class defines itself (``memory_available``, ``capture_graph``, ``supports_graphs``, ...) are
taken over by its runtime when it is made, bound to the ops object (see :data:`ONE_CLASS_SERVICES`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, List, Optional, Tuple

import torch

# what a device can record: nothing; whole steps (decode steps, and steps with prompt rows where
# ``records_mixed_steps``: engine/graph_runner.py); or steps with prompt rows only, as a chain of graphs cut at
# each attention layer (engine/piecewise.py)
GRAPHS_NONE, GRAPHS_STEPS, GRAPHS_PIECES = 'none', 'steps', 'pieces'


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """How the engine runs on a device, read once at start-up (engine/rank.py turns it into a RankPlan)."""
    graphs: str = GRAPHS_NONE  # GRAPHS_NONE / GRAPHS_STEPS / GRAPHS_PIECES
    records_mixed_steps: bool = True  # with GRAPHS_STEPS: steps with prompt rows are recorded too
    profile_memory: bool = False  # size the KV cache after a profiling forward pass (allocators that keep
    # activation memory reserved)
    memory_is_host_ram: bool = False  # the KV cache is capped by cpu_kv_cache_cap_gb
    default_max_batch_size: int = 256

    @classmethod
    def from_flags(cls, base: 'ExecutionPlan', supports_graphs: Optional[bool] = None,
                   supports_graph_pieces: Optional[bool] = None, **fields) -> 'ExecutionPlan':
        """``base`` with a one-class device's capability flags (the names DeviceOps had before the split)."""
        graphs = base.graphs
        if supports_graphs is not None or supports_graph_pieces is not None:
            steps = supports_graphs if supports_graphs is not None else graphs == GRAPHS_STEPS
            pieces = supports_graph_pieces if supports_graph_pieces is not None else graphs == GRAPHS_PIECES
            graphs = GRAPHS_STEPS if steps else GRAPHS_PIECES if pieces else GRAPHS_NONE
        return dataclasses.replace(base, graphs=graphs, **fields)

    def describe(self) -> str:
        graphs = {GRAPHS_NONE: 'eager steps', GRAPHS_PIECES: 'steps with prompt rows recorded in pieces',
                  GRAPHS_STEPS: 'whole steps recorded' + ('' if self.records_mixed_steps else ' (decode only)')}
        memory = ('host RAM' if self.memory_is_host_ram else 'device memory') + (
            ', profiled' if self.profile_memory else '')
        return f'{graphs[self.graphs]}; KV cache in {memory}; default max batch {self.default_max_batch_size}'


# ExecutionPlan fields a one-class device may set as class attributes
_PLAN_FLAGS = ('supports_graphs', 'supports_graph_pieces', 'records_mixed_steps', 'profile_memory',
               'memory_is_host_ram', 'default_max_batch_size')
# services a one-class device may define on its ops class (its runtime takes them over)
ONE_CLASS_SERVICES = ('torch_device_type', 'collective_backend', 'ray_resource', 'torch_device', 'set_device_index',
                      'memory_available', 'synchronize', 'to_host_async', 'timestamp', 'seconds_between',
                      'capture_graph', 'capture_pieces')


class DeviceRuntime:
    """Services of one device kind. The defaults are those of a device whose ops run as they are called, on
    tensors of ``torch_device_type``; a device overrides what differs."""

    name: str = 'abstract'  # the device_type (its ops' name, set per instance)
    torch_device_type: str = 'cpu'  # torch's name for the device its tensors live on
    auto_priority: int = 0  # device_type='auto' picks the available device that ranks highest
    PLAN = ExecutionPlan()  # the device's plan; an instance's ``plan`` may add a one-class device's flags

    # tensor parallelism: one process per rank, each on its own device; they talk through a torch.distributed
    # process group (the default group, one member per rank) of this backend: 'gloo' on the cpu, 'nccl' on cuda
    collective_backend: str = 'gloo'
    ray_resource: Optional[str] = None  # the Ray resource one rank reserves (e.g. 'GPU'); None: only a CPU
    # the variable that lists a process's visible devices, which Ray narrows to an actor's own device unless
    # told not to: a rank then keeps its node's every device in view and uses its own by index (peer-to-peer
    # transfers between the ranks' devices need the peer device visible in each process)
    visible_devices_env: Optional[str] = None

    def __init__(self, ops=None):
        """``ops``: the device's DeviceOps object (its name; a one-class device's own services)."""
        self.ops = ops
        if ops is None:
            self.plan = self.PLAN
            return
        self.name = ops.name
        from .interface import DeviceOps
        cls = type(ops)
        for attr in ONE_CLASS_SERVICES:
            own = getattr(cls, attr, None)
            if own is not None and own is not getattr(DeviceOps, attr, None):
                setattr(self, attr, getattr(ops, attr))
        flags = {f: getattr(cls, f) for f in _PLAN_FLAGS if hasattr(cls, f)}
        self.plan: ExecutionPlan = ExecutionPlan.from_flags(self.PLAN, **flags) if flags else self.PLAN

    # ---------------------------------------------------------------- identity
    @classmethod
    def is_available(cls) -> bool:
        """True if this process can run on the device."""
        raise NotImplementedError

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """None where :meth:`is_available`; else why not, in words a user can act on (what is missing,
        what to install). A device says more by overriding it."""
        return None if cls.is_available() else f'{cls.__name__}.is_available() is False here'

    @classmethod
    def describe(cls) -> List[Tuple[str, str]]:
        """(label, value) rows about this machine's side of the device (drivers, device names, libraries),
        for ``lmdeploy check_env``; never raises, and works where the device is not available."""
        return []

    def torch_device(self) -> torch.device:
        return torch.device(self.torch_device_type)

    def set_device_index(self, index: int) -> None:
        """Make this machine's device ``index`` the one :meth:`torch_device` names (before anything is
        allocated). Devices with one device per machine ignore it."""

    # ------------------------------------------------------------------ memory
    def memory_available(self) -> int:
        """Bytes free for the KV cache right now."""
        raise NotImplementedError

    def release_cached_memory(self) -> None:
        """Give back to the device what the framework's allocator holds unused (loading's temporaries), so
        that :meth:`memory_available` counts it. Devices whose allocator keeps nothing do nothing."""

    def start_peak_count(self) -> None:
        """Start counting the allocator's high-water mark (:meth:`peak_bytes_since_start`)."""

    def peak_bytes_since_start(self) -> int:
        """The most bytes the framework's allocator held beyond what it held at :meth:`start_peak_count`: a
        step's activations, which the engine keeps out of the KV cache's budget for the recorded steps' own
        pool. 0 where the device keeps no such count."""
        return 0

    # ------------------------------------------------------ queue and timing
    def synchronize(self) -> None:
        """Wait until queued work on the device is done."""

    def to_host_async(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start copying ``t`` to host memory behind the work queued so far;
        returns a function that waits for the copy and gives the host tensor.
        Lets the host prepare the next step while this one still runs."""
        host = t.cpu()
        return lambda: host

    def timestamp(self) -> Any:
        """A mark in the device's queue, reached once the work queued before
        it is done (to time steps on the device, not on the host, which runs
        ahead of it). Ops of this default run as they are called, so the host
        clock serves."""
        return time.perf_counter()

    def seconds_between(self, start: Any, end: Any) -> Optional[float]:
        """Device seconds from mark ``start`` to mark ``end``, or None while
        the device has not reached ``end`` (never waits)."""
        return end - start

    # ----------------------------------------------------------- graph capture
    # replaying a recorded step saves the per-kernel launch cost; which of these the engine uses is the plan's
    def capture_graph(self, fn: Callable[[], Any], pool: Any = None) -> Tuple[Callable[[], None], Any, Any]:
        """Warm up, then record ``fn()`` (which only touches tensors that stay
        alive). Returns (replay, outputs, pool): each ``replay()`` re-runs the
        recorded work and rewrites ``outputs`` in place; graphs recorded with
        the same ``pool`` share their memory (pass None for the first)."""
        raise NotImplementedError(f'device {self.name!r} has no graph capture')

    def capture_pieces(self, fn: Callable[[Callable[[], None]], Any],
                       pool: Any = None) -> Tuple[List[Callable[[], None]], Any, Any]:
        """Warm up, then record ``fn(cut)`` as consecutive graphs: each call of
        ``cut()`` ends the graph being recorded and starts the next (the
        caller runs its own work between their replays). Returns (replays in
        order, fn's outputs, pool), as :meth:`capture_graph` does."""
        raise NotImplementedError(f'device {self.name!r} cannot record graphs in pieces')

    # ------------------------------------------------------ tensor parallelism
    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` into every rank's ``x`` (same shape and dtype everywhere), in place: the
        engine's commands to the other ranks (engine/parallel/channel.py)."""
        import torch.distributed as dist
        dist.broadcast(x, src)
        return x
