"""What the frontend uses of an engine: :class:`EngineLike`.

Two classes implement it: :class:`~lmdeploy.engine.engine.Engine` (the loop on
a thread of this process) and :class:`~lmdeploy.engine.process.EngineProcess`
(the same loop in a child process). The gateway, the pipeline, the server
and the chat page hold either as ``gateway.engine`` and touch nothing else of
it; tests/test_engine_protocol.py checks that both classes implement every
member with a compatible signature, and that the frontend and the server use
no attribute of an engine outside this list.

Nothing here imports torch: the process-side engine and the checks stay light.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .engine import EngineRequest, EngineStats
    from .model_config import ModelConfig


@runtime_checkable
class EngineLike(Protocol):
    """An engine as the frontend sees it. Requests and their outputs travel through ``submit`` (outputs
    come back through the request's callback, on another thread); the rest is sizes and control."""

    # ---- what was built (fixed once the engine is ready)
    model_config: 'ModelConfig'  # the checkpoint's config.json: vocab_size, eos_token_ids, model_type, ...
    session_len: int  # tokens a session holds, prompt and output together
    num_blocks: int  # KV cache blocks
    block_size: int  # tokens per block
    max_batch_size: int  # sequences in one step
    quant_policy: int  # of the KV cache: 0, 8 or 4
    device_name: str  # the device the model runs on ('cpu', 'cuda', ...)

    # ---- requests (thread-safe, never block)
    def submit(self, req: 'EngineRequest') -> None:
        """Queue a request; its outputs arrive through ``req.on_output``, the last one ``finished``."""

    def cancel(self, session_id: int) -> None:
        """Stop the session's running request (it finishes as 'abort'; an interactive one keeps its cache)."""

    def end_session(self, session_id: int) -> None:
        """Stop the session's request, if any, and free its cache."""

    # ---- state
    def stats(self) -> 'EngineStats':
        """Queues, KV blocks and counters (waits for the step the engine is in, if any)."""

    def check_invariants(self) -> None:
        """Raise AssertionError unless every KV block is free or owned, counts consistent."""

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until nothing is queued or running; False if that took longer than ``timeout`` s."""

    def is_alive(self) -> bool:
        """True while the engine accepts and runs requests."""

    def close(self) -> None:
        """Stop the engine: requests still running end as 'abort'."""


@dataclass(frozen=True)
class EngineInfo:
    """The sizes of a built engine, as the engine process sends them to its parent once it is ready
    (the data members of :class:`EngineLike`)."""
    model_config: Any  # ModelConfig
    session_len: int
    num_blocks: int
    block_size: int
    max_batch_size: int
    quant_policy: int
    device_name: str
    dtype: Any  # torch.dtype of the weights

    @classmethod
    def of(cls, engine) -> 'EngineInfo':
        return cls(model_config=engine.model_config, session_len=engine.session_len, num_blocks=engine.num_blocks,
                   block_size=engine.block_size, max_batch_size=engine.max_batch_size,
                   quant_policy=engine.quant_policy, device_name=engine.device_name, dtype=engine.dtype)
