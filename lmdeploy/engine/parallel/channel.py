"""How rank 0 tells the other ranks what to run: broadcasts on the device's
process group (no second IPC path). A command is a fixed-size header (the
command and a few integers) and, for most, one int64 payload."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..transfer import int64_tensor, to_device

FORWARD = 1  # header: the step's StepMeta; payload: packed inputs, then the resolved input ids
LOGITS = 2  # payload: rows of the last step's hidden states
STOP = 3

_HEADER = 12


class Channel:

    def __init__(self, runtime):
        """``runtime``: the device's runtime (its broadcast, in the process group of the ranks)."""
        self.runtime = runtime
        self.torch_device = runtime.torch_device()

    def send(self, cmd: int, args: Sequence[int] = (), payload: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rank 0: broadcast a command (``payload``: an int64 tensor on the device). Returns the header on the
        device (reading it back waits until the broadcast has left this rank)."""
        n = 0 if payload is None else payload.numel()
        header = [cmd, n, *args]
        if len(header) > _HEADER:
            raise ValueError(f'command header too long: {header}')
        sent = self.runtime.broadcast(to_device(int64_tensor(header + [0] * (_HEADER - len(header))), self.torch_device))
        if n:
            self.runtime.broadcast(payload)
        return sent

    def receive(self) -> Tuple[int, list, Optional[torch.Tensor]]:
        """Other ranks: wait for the next command; returns (cmd, args, payload)."""
        header = self.runtime.broadcast(torch.empty(_HEADER, dtype=torch.int64, device=self.torch_device)).tolist()
        cmd, n, args = header[0], header[1], header[2:]
        payload = None
        if n:
            payload = self.runtime.broadcast(torch.empty(n, dtype=torch.int64, device=self.torch_device))
        return cmd, args, payload
