"""The periodic health check: every node's ``GET /health``, all at once, every ``interval`` seconds.

200 makes a node healthy (it gets requests again); 503 (loading, draining, engine gone) keeps it in
the table without requests; no answer at all (refused, reset, timed out) counts a failure, and a
node that fails ``drop_after`` checks in a row is dropped from the table. A node dropped or
restarted joins again by registering (an api_server with ``--proxy-url`` does at start-up).
"""
from __future__ import annotations

import asyncio
import logging

import httpx

from .nodes import Node, NodeTable

logger = logging.getLogger('lmdeploy.serve.proxy')


class HealthChecker:

    def __init__(self, table: NodeTable, client: httpx.AsyncClient, interval: float = 10.0, drop_after: int = 3,
                 timeout: float = 5.0):
        if interval <= 0:
            raise ValueError(f'the health check interval must be > 0 seconds, got {interval}')
        if drop_after < 1:
            raise ValueError(f'drop_after must be >= 1 failed check, got {drop_after}')
        self.table, self.client = table, client
        self.interval, self.drop_after = interval, drop_after
        self.timeout = min(timeout, interval)

    async def check(self, node: Node) -> str:
        """One node's state now: healthy, not_ready or unreachable."""
        try:
            r = await self.client.get(node.url + '/health', timeout=self.timeout)
        except httpx.HTTPError:
            return 'unreachable'
        if r.status_code == 200:
            return 'healthy'
        return 'not_ready' if r.status_code == 503 else 'unreachable'

    async def check_all(self):
        nodes = list(self.table.nodes.values())
        states = await asyncio.gather(*(self.check(n) for n in nodes))
        for node, state in zip(nodes, states):
            if self.table.get(node.url) is not node:
                continue  # removed (or registered again) while it was checked
            if state == 'unreachable':
                node.failures += 1
                if node.failures >= self.drop_after:
                    self.table.remove(node.url, f'dropped after {node.failures} failed health checks')
                    continue
            else:
                node.failures = 0
            if state != node.state:
                logger.warning('node %s is %s', node.url, state.replace('_', ' '))
                node.state = state

    async def run(self):
        while True:
            try:
                await self.check_all()
            except Exception:  # never let one bad round stop the checks
                logger.exception('health check failed')
            await asyncio.sleep(self.interval)
