"""Which node gets the next request. Pure Python: the strategies see only numbers each node keeps.

``random``                 a node drawn at random, weighted by its speed (requests a second it completes)
``min_expected_latency``   the node whose queue clears first: (its unfinished requests, queued plus
                           running there, + 1) / its speed
``min_observed_latency``   the node whose recent requests took least time on average (ties: fewest
                           unfinished requests)

They choose among the nodes that have room now (:mod:`.forward`): a request that finds none waits in
the proxy and goes to the first node that finishes one, so a stale speed decides only which of the
nodes with room is first, never how much work a node is handed up front.

A node not yet measured is given the mean speed of the measured ones (1 when none is), and, for
``min_observed_latency``, the best latency seen, so a new node is tried at once without being
flooded before its first answer.
"""
from __future__ import annotations

import math
import random
from typing import Optional, Protocol, Sequence

STRATEGIES = ('random', 'min_expected_latency', 'min_observed_latency')


class Measured(Protocol):
    """What a strategy reads of a node (:class:`~lmdeploy.serve.proxy.nodes.Node` has it)."""
    unfinished: int

    def speed(self) -> Optional[float]:
        ...

    def observed_latency(self) -> Optional[float]:
        ...


def _speeds(nodes: Sequence[Measured]):
    known = [s for s in (n.speed() for n in nodes) if s is not None and s > 0]
    fill = sum(known) / len(known) if known else 1.0
    return [s if s is not None and s > 0 else fill for s in (n.speed() for n in nodes)]


def _pick_min(nodes, scores, rng):
    best = min(scores)
    tied = [n for n, s in zip(nodes, scores) if math.isclose(s, best, rel_tol=1e-9, abs_tol=1e-12)]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def choose(strategy: str, nodes: Sequence[Measured], rng: Optional[random.Random] = None):
    """The node that gets the next request (``nodes``: the candidates, never empty)."""
    if not nodes:
        raise ValueError('no node to choose from')
    rng = rng or random
    if strategy == 'random':
        return rng.choices(list(nodes), weights=_speeds(nodes))[0]
    if strategy == 'min_expected_latency':
        scores = [(n.unfinished + 1) / s for n, s in zip(nodes, _speeds(nodes))]
        return _pick_min(nodes, scores, rng)
    if strategy == 'min_observed_latency':
        seen = [n.observed_latency() for n in nodes]
        known = [x for x in seen if x is not None]
        fill = min(known) if known else 0.0
        lat = [x if x is not None else fill for x in seen]
        best = min(lat)
        close = [n for n, x in zip(nodes, lat) if math.isclose(x, best, rel_tol=1e-9, abs_tol=1e-12)]
        return _pick_min(close, [n.unfinished for n in close], rng)
    raise ValueError(f'unknown strategy {strategy!r}; choose one of {", ".join(STRATEGIES)}')
