"""All-reduce of a step's small messages through peer-to-peer buffers.

Under tensor parallelism every layer sums its rows over the ranks twice. In a
decode step the message is a few KB to a few MB, where NCCL's ring spends
its time in protocol and latency, not bandwidth. Here each rank copies its
rows into a buffer every rank can read (torch's symmetric memory), waits at a
barrier, and reads and adds the others' copies itself over NVLink (one shot):
one kernel, recorded in the step's CUDA graph like any other.

No NVLink multicast is used (only peer loads): multicast objects are turned
off before the buffers are made. Larger messages, other dtypes, and ranks
where the buffers cannot be made (every rank agrees) go to NCCL.

``LMDEPLOY_ALLREDUCE=nccl`` turns this off; ``LMDEPLOY_ONE_SHOT_BYTES`` sets
the largest message it takes."""
from __future__ import annotations

import logging
import os
from typing import Dict, Optional

import torch

logger = logging.getLogger('lmdeploy')

# the largest message summed in one shot. Every rank reads every other rank's whole message, so the cost
# grows with (ranks - 1) x bytes: past this, NCCL's ring (each byte crosses the links once) is as fast
DEFAULT_MAX_BYTES = 2 << 20
_DTYPES = (torch.bfloat16, torch.float32)  # those torch's one-shot kernel sums


class PeerAllReduce:
    """One device's one-shot all-reduce over process group ``world`` (the default group of the ranks: an
    engine that starts after another one closed has a new group, and a new one of these). Its buffers are made
    on the first call (every rank makes its first all-reduce call at the same point of the same step, so the
    buffers' rendezvous lines up)."""

    def __init__(self, world):
        self.world = world
        self.max_bytes = int(os.environ.get('LMDEPLOY_ONE_SHOT_BYTES', DEFAULT_MAX_BYTES))
        self.enabled = os.environ.get('LMDEPLOY_ALLREDUCE', 'auto') != 'nccl' and self.max_bytes > 0
        self._ready: Optional[bool] = None
        self._buffers: Dict[torch.dtype, torch.Tensor] = {}
        self._group = ''
        self._copy_out = None

    def __call__(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The sum of ``x`` over the ranks in a new tensor, or None where this does not take ``x`` (the caller
        uses NCCL)."""
        if not self.enabled or x.dtype not in _DTYPES:
            return None
        if self._ready is None:
            if torch.cuda.is_current_stream_capturing():
                return None  # (never: the eager start-up runs first) a rendezvous cannot run inside a recording
            self._ready = self._setup()
        if not self._ready or x.numel() * x.element_size() > self.max_bytes:
            return None
        x = x.contiguous()
        buf = self._buffers[x.dtype][:x.numel()]
        out = torch.empty_like(x)
        if self._copy_out is not None:  # copy in and sum in one kernel
            self._copy_out(buf, x.view(-1), 'sum', self._group, out.view(-1))
        else:
            buf.copy_(x.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(buf, 'sum', self._group, out.view(-1))
        return out

    def _setup(self) -> bool:
        """Make the buffers (one per dtype) on every rank; True on every rank where all ranks could, False on
        every rank otherwise. The ranks first agree that every one can try (a rank that skips the buffers'
        rendezvous would leave the others waiting in it)."""
        self._group = self.world.group_name
        # torch keeps a group's symmetric-memory store by the group's name for the life of the process, and the
        # default group's name comes back when an engine starts after another one closed (tests, notebooks):
        # the new ranks would meet at the old group's store. Such a group sums through NCCL.
        if not _all_ranks(self.world, self._group not in _USED_NAMES):
            logger.info('one-shot all-reduce: process group %r was named before in this process; NCCL sums '
                        'every message', self._group)
            return False
        ok = True
        try:
            os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST'] = '1'  # peer loads only (see the module's note)
            import torch.distributed._symmetric_memory as symm_mem
            _USED_NAMES.add(self._group)
            if not symm_mem.is_symm_mem_enabled_for_group(self._group):
                symm_mem.enable_symm_mem_for_group(self._group)
            dev = torch.device('cuda', torch.cuda.current_device())
            for dtype in _DTYPES:
                buf = symm_mem.empty(self.max_bytes // torch.empty(0, dtype=dtype).element_size(), dtype=dtype,
                                     device=dev)
                symm_mem.rendezvous(buf, self._group)
                self._buffers[dtype] = buf
            self._copy_out = _copy_out_op()
        except Exception as e:  # an old torch, a GPU without peer access, a sandbox without handle exchange
            logger.warning('one-shot all-reduce unavailable (%s: %s); NCCL sums every message', type(e).__name__, e)
            ok = False
        ready = _all_ranks(self.world, ok)
        if ready:
            logger.info('one-shot all-reduce through peer buffers for messages up to %d KB', self.max_bytes >> 10)
        else:
            self._buffers.clear()
        return ready


_USED_NAMES = set()  # process groups whose symmetric memory this process set up, by name


def _all_ranks(world, flag: bool) -> bool:
    """True where ``flag`` is True on every rank of ``world`` (a collective)."""
    import torch.distributed as dist
    t = torch.tensor([int(flag)], device=torch.device('cuda', torch.cuda.current_device()))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=world)
    return bool(t.item())


def _copy_out_op():
    """torch's copy-in-and-sum one-shot op where this torch has it with the arguments expected, else None."""
    packet = getattr(torch.ops.symm_mem, 'one_shot_all_reduce_copy_out', None)
    if packet is None:
        return None
    try:
        names = [a.name for a in packet.default._schema.arguments]
    except Exception:
        return None
    return packet if names == ['symm_buffer', 'local_input', 'reduce_op', 'group_name', 'out'] else None
