"""Drive an Engine directly (token ids in, token ids out) for tests."""
from __future__ import annotations

import threading
from typing import List, Optional

from lmdeploy.engine.engine import Engine, EngineRequest
from lmdeploy.engine.sequence import EngineOutput, SamplingParams


class Collector:
    """Gathers one request's outputs; ``wait`` returns when it finished."""

    def __init__(self):
        self.token_ids: List[int] = []
        self.outputs: List[EngineOutput] = []
        self.done = threading.Event()

    def __call__(self, out: EngineOutput):
        self.outputs.append(out)
        self.token_ids.extend(out.new_token_ids)
        if out.finished:
            self.done.set()

    @property
    def final(self) -> EngineOutput:
        return self.outputs[-1]

    def wait(self, timeout: float = 120) -> 'Collector':
        assert self.done.wait(timeout), 'request did not finish in time'
        return self


_next_id = [10_000]


def submit(engine: Engine, ids: List[int], params: Optional[SamplingParams] = None, session_id: int = None,
           interactive: bool = False) -> Collector:
    if session_id is None:
        _next_id[0] += 1
        session_id = _next_id[0]
    col = Collector()
    engine.submit(EngineRequest(session_id, list(ids), params or SamplingParams(), col, interactive=interactive))
    return col


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    """Greedy with no stop tokens: always exactly max_new_tokens."""
    return SamplingParams(max_new_tokens=max_new_tokens, greedy=True, **kw)


def generate_all(engine: Engine, prompts: List[List[int]], params: SamplingParams) -> List[List[int]]:
    """Submit every prompt at once (so they share batches), wait for all."""
    cols = [submit(engine, p, params) for p in prompts]
    return [c.wait().token_ids for c in cols]


def assert_engine_clean(engine: Engine):
    """Idle, every block free or owned consistently, and all free unless a
    chat session keeps its cache."""
    assert engine.wait_idle(), 'engine did not become idle'
    engine.check_invariants()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    if stats.num_idle_sessions == 0:
        assert stats.num_free_blocks == stats.num_blocks, stats


def engine_tokens(path: str, prompts: List[List[int]], new_tokens: int, **config) -> List[List[int]]:
    """Greedy tokens (exactly ``new_tokens`` per prompt, all prompts submitted at once) of an engine started
    for this call on ``path`` with PytorchEngineConfig(**config), closed afterwards."""
    from lmdeploy.messages import PytorchEngineConfig
    engine = Engine(path, PytorchEngineConfig(**config))
    try:
        return generate_all(engine, prompts, greedy(new_tokens))
    finally:
        engine.close()


class EngineCache:
    """Engines kept open for the tests of one module (a module-scoped fixture's): ``get(path, **config)``
    starts one engine per (path, config) and hands the same one out again; ``close()`` closes them all.
    Only for tests that submit requests and read their tokens (no prefix caching, so an engine's earlier
    requests leave nothing a later one reads)."""

    def __init__(self):
        self._engines = {}

    def get(self, path: str, **config) -> Engine:
        from lmdeploy.messages import PytorchEngineConfig
        assert not config.get('enable_prefix_caching'), 'a shared engine must not carry cache between tests'
        key = (path, tuple(sorted(config.items())))
        engine = self._engines.get(key)
        if engine is None or not engine.is_alive():
            engine = self._engines[key] = Engine(path, PytorchEngineConfig(**config))
        return engine

    def tokens(self, path: str, prompts: List[List[int]], new_tokens: int, **config) -> List[List[int]]:
        engine = self.get(path, **config)
        out = generate_all(engine, prompts, greedy(new_tokens))
        assert_engine_clean(engine)
        return out

    def close(self):
        while self._engines:
            self._engines.popitem()[1].close()
