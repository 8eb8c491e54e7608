"""ServerState: what the request handlers share (gateway, API keys, sessions, metrics)."""
from __future__ import annotations

import hashlib
import hmac
from typing import Optional, Sequence, Tuple

from .metrics import ServerMetrics
from .sessions import Sessions


class ServerState:
    """What the handlers share; ``app.state.lmdeploy``."""

    def __init__(self, gateway, model_name: Optional[str], api_keys: Optional[Sequence[str]],
                 max_log_len: Optional[int], tool_call_parser: Optional[str] = None):
        self.gateway = None
        self.tool_call_parser = tool_call_parser
        self._tool_format = None
        self.model_name = model_name
        self.api_key_digests = [self.key_digest(k) for k in (api_keys or []) if k]
        self.max_log_len = max_log_len
        self.draining = False
        self.runs: set = set()  # the requests generating now (jobs._Run)
        self.cut_reason: Optional[str] = None  # set when the drain ends what still runs
        self.sessions = Sessions()
        self.metrics = ServerMetrics(lambda: self.gateway.engine if self.gateway is not None else None)
        if gateway is not None:
            self.set_gateway(gateway)

    def set_gateway(self, gateway):
        """Attach the gateway (an app created with ``gateway=None`` answers 503 until then)."""
        self.gateway = gateway
        self._tool_format = None
        if not self.model_name:
            self.model_name = gateway.model_name

    def tool_format(self):
        """How the served model writes tool calls (``--tool-call-parser``, else detected)."""
        if self._tool_format is None:
            self._tool_format = self.gateway.tool_format(self.tool_call_parser)
        return self._tool_format

    def key_ok(self, key: Optional[str]) -> bool:
        if not self.api_key_digests:
            return True
        given = self.key_digest(key)
        ok = False
        for digest in self.api_key_digests:  # no early exit: constant time over the keys
            ok |= hmac.compare_digest(given, digest)
        return ok and bool(key)

    @staticmethod
    def key_digest(key: Optional[str]) -> bytes:
        """What the server keeps of a key: its SHA-256 (also the owner of the key's sessions)."""
        return hashlib.sha256((key or '').encode()).digest()

    def cut_running(self, why: str = 'the server is shutting down: this request was cut short'):
        """End every running request with an error (the drain's time is up, or a second signal came)."""
        self.cut_reason = why
        for run in list(self.runs):
            run.cut(why)

    def not_ready(self) -> Optional[Tuple[str, str]]:
        """(message, code) when requests cannot be served now, else None."""
        if self.draining:
            return 'the server is shutting down', 'shutting_down'
        if self.gateway is None:
            return 'the engine is not ready yet', 'engine_not_ready'
        engine = self.gateway.engine
        if not engine.is_alive():
            return 'the engine has stopped', 'engine_stopped'
        return None

    def clip(self, text: str) -> str:
        if self.max_log_len is None or len(text) <= self.max_log_len:
            return text
        return text[:self.max_log_len] + f'...[{len(text) - self.max_log_len} more]'
