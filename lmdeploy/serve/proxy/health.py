"""The periodic health check: every node's ``GET /health``, all at once, every ``interval`` seconds.

200 makes a node healthy (it gets requests again, whatever it was before, dropped included); 503
(loading, draining, engine gone) keeps it in the table without requests; no answer at all (refused,
reset, timed out) counts a failed check. Only health checks count here: a request that found no
answer takes its node out of rotation until the next check, but adds nothing towards dropping it.
A node whose last ``drop_after`` checks all failed is *dropped*: its address is kept and probed on
every round, so a node that was only paused or restarting gets traffic again as soon as it answers;
a dropped node that has not answered for ``forget_after`` seconds is removed from the table (0:
never). An api_server with ``--proxy-url`` also registers again every so often, so a proxy that
restarted without its state file, or forgot it, gets it back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

import httpx

from .nodes import Node, NodeTable

logger = logging.getLogger('lmdeploy.serve.proxy')


class HealthChecker:

    def __init__(self, table: NodeTable, client: Optional[httpx.AsyncClient], interval: float = 10.0,
                 drop_after: int = 3, timeout: float = 5.0, forget_after: float = 3600.0,
                 on_change: Optional[Callable[[], None]] = None):
        if interval <= 0:
            raise ValueError(f'the health check interval must be > 0 seconds, got {interval}')
        if drop_after < 1:
            raise ValueError(f'drop_after must be >= 1 failed check, got {drop_after}')
        if forget_after < 0:
            raise ValueError(f'forget_after must be >= 0 seconds (0: never), got {forget_after}')
        self.table, self.client = table, client
        self.interval, self.drop_after, self.forget_after = interval, drop_after, forget_after
        self.timeout = min(timeout, interval)
        self.on_change = on_change or (lambda: None)

    async def check(self, node: Node, timeout: Optional[float] = None) -> str:
        """One node's state now: healthy, not_ready or unreachable."""
        try:
            r = await self.client.get(node.url + '/health', timeout=timeout or self.timeout)
        except httpx.HTTPError:
            return 'unreachable'
        if r.status_code == 200:
            return 'healthy'
        return 'not_ready' if r.status_code == 503 else 'unreachable'

    def apply(self, node: Node, state: str):
        """What one check of ``node`` found."""
        if state != 'unreachable':
            node.failed_checks = 0
            self.table.set_state(node, state)
            return
        node.failed_checks += 1
        if node.state == 'dropped':
            if self.forget_after and time.time() - node.dropped_at >= self.forget_after:
                self.table.remove(node.url, f'forgotten: no answer for {self.forget_after:g} s since it was '
                                  'dropped')
            return
        if node.failed_checks >= self.drop_after:
            self.table.set_state(node, 'dropped', f'{node.failed_checks} failed health checks in a row; still '
                                 f'probed every {self.interval:g} s' + (f', forgotten after {self.forget_after:g} s'
                                                                       if self.forget_after else ''))
        else:
            self.table.set_state(node, 'unreachable', 'no answer to the health check')

    async def check_all(self):
        nodes = list(self.table.nodes.values())
        states = await asyncio.gather(*(self.check(n) for n in nodes))
        for node, state in zip(nodes, states):
            if self.table.get(node.url) is not node:
                continue  # removed (or registered again) while it was checked
            self.apply(node, state)
        self.on_change()

    async def run(self):
        while True:
            try:
                await self.check_all()
            except Exception:  # never let one bad round stop the checks
                logger.exception('health check failed')
            await asyncio.sleep(self.interval)
