"""How rank 0 tells the other ranks what to run: a socket from rank 0 to each
rank, on the host. A command is a fixed-size header (the command, the
payload's length and a few integers) and, for most, an int64 payload.

The host carries the commands, not the device's process group: a rank learns
what the next step is as soon as rank 0's host knows it, while the devices
still run the step before, and queues its own step behind that one (a command
broadcast on the device arrives only once rank 0's device reaches it, so
every rank's host work for a step would sit on the step's critical path).
What only rank 0's device holds (the tokens sampled by the step in flight)
follows on the device, in step order (driver.py)."""
from __future__ import annotations

import socket
import struct
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

FORWARD = 1  # header: the step's StepMeta; payload: the packed inputs (model_runner.py)
LOGITS = 2  # payload: rows of the last step's hidden states
STOP = 3
GREEDY = 4  # as LOGITS, for a greedy pick (each rank picks in its vocabulary rows)
GONE = -1  # not sent: what a rank reads once rank 0 has closed the channel (it exits without waiting on anything)

_HEADER = 12  # int64 fields: command, payload length, then up to 10 arguments
_HEADER_BYTES = 8 * _HEADER
_HELLO = struct.Struct('<q')  # a rank's first message: its rank


class Listener:
    """Rank 0's end before the ranks start: a listening socket whose port the ranks are told."""

    def __init__(self, host: str):
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]

    def accept(self, world: int, timeout: float, gone) -> 'Commands':
        """Wait for ranks 1..world-1 to connect (``gone()``: why a rank is gone, or None)."""
        conns: Dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout
        self.sock.settimeout(0.2)
        try:
            while len(conns) < world - 1:
                why = gone()
                if why:
                    raise RuntimeError(f'tensor-parallel start-up failed: {why}')
                if time.monotonic() > deadline:
                    raise RuntimeError(f'tensor-parallel start-up: not every rank connected within {timeout:.0f} s')
                try:
                    conn, _ = self.sock.accept()
                except socket.timeout:
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns[_HELLO.unpack(_recv_exact(conn, _HELLO.size))[0]] = conn
        except BaseException:
            for conn in conns.values():
                conn.close()
            raise
        finally:
            self.close()
        return Commands([conns[r] for r in sorted(conns)])

    def close(self):
        self.sock.close()


class Commands:
    """Rank 0's end: sends every command to every other rank."""

    def __init__(self, conns: List[socket.socket]):
        self.conns = conns

    def send(self, cmd: int, args: Sequence[int] = (), payload: Optional[np.ndarray] = None):
        """``payload``: int64 values (a numpy array or a host tensor)."""
        n = 0 if payload is None else len(payload)
        header = [cmd, n, *args]
        if len(header) > _HEADER:
            raise ValueError(f'command header too long: {header}')
        data = np.array(header + [0] * (_HEADER - len(header)), dtype=np.int64).tobytes()
        if n:
            data += np.asarray(payload, dtype=np.int64).tobytes()
        for conn in self.conns:
            conn.sendall(data)

    def close(self):
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        self.conns = []


class Receiver:
    """A rank's end: the commands rank 0 sends, in order."""

    def __init__(self, host: str, port: int, rank: int):
        self.conn = socket.create_connection((host, port))
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn.sendall(_HELLO.pack(rank))

    def receive(self) -> Tuple[int, list, Optional[torch.Tensor]]:
        """Wait for the next command; returns (cmd, args, payload: a host int64 tensor or None). Rank 0
        gone (the socket closed) reads as GONE."""
        try:
            header = np.frombuffer(_recv_exact(self.conn, _HEADER_BYTES), dtype=np.int64).tolist()
        except (EOFError, ConnectionError):
            return GONE, [], None
        cmd, n, args = header[0], header[1], header[2:]
        payload = None
        if n:
            buf = bytearray(8 * n)
            _recv_into(self.conn, buf)
            payload = torch.frombuffer(buf, dtype=torch.int64)
        return cmd, args, payload

    def close(self):
        self.conn.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, buf)
    return bytes(buf)


def _recv_into(conn: socket.socket, buf: bytearray):
    view, got = memoryview(buf), 0
    while got < len(buf):
        k = conn.recv_into(view[got:])
        if not k:
            raise EOFError('rank 0 closed the command channel')
        got += k
