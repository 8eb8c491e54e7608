"""The node table: every api_server the proxy spreads requests over, and what it measured of each.

A node is keyed by its base URL. Adding a URL that is already there (a restarted node registering
again, or a live one's periodic registration) keeps its measurements and its state: the proxy then
asks the node's ``/health`` itself (:mod:`.app`). A node's states: ``healthy`` (gets requests),
``not_ready`` (answered 503), ``unreachable`` (a request or a health check got no answer) and
``dropped`` (``drop_after`` health checks in a row got none): only a healthy node gets requests, and
every other one is still probed, so a node that answers ``/health`` again gets traffic again. With a
file (``--state-file``) the table's URLs, models, given speeds and batch sizes (and which nodes are
dropped) are written on every change and read at start-up, so a restarted proxy keeps its nodes (the
health check then finds out which are still alive).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections import deque
from typing import Dict, List, Optional
from urllib.parse import urlsplit

logger = logging.getLogger('lmdeploy.serve.proxy')

WINDOW = 32  # finished requests a node's speed and latency are measured over


def normalize_url(url: str) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing slash; ValueError for anything else."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError('a node URL is required, e.g. http://10.0.0.2:23333')
    url = url.strip().rstrip('/')
    parts = urlsplit(url)
    if parts.scheme not in ('http', 'https') or not parts.hostname:
        raise ValueError(f'a node URL must be http(s)://HOST:PORT, got {url!r}')
    if parts.query or parts.fragment:
        raise ValueError(f'a node URL takes no query or fragment, got {url!r}')
    try:
        parts.port
    except ValueError as e:
        raise ValueError(f'bad port in node URL {url!r}: {e}') from None
    return url


class Node:
    """One api_server: its models, health, and the requests it has and had."""

    def __init__(self, url: str, models: Optional[List[str]] = None, given_speed: Optional[float] = None,
                 max_batch_size: Optional[int] = None):
        self.url = url
        self.models = list(models) if models else None  # None: unknown, any model is sent to it
        self.given_speed = given_speed  # requests a second, as registered; until it is measured
        self.max_batch_size = max_batch_size  # sequences its engine runs at once, as registered (None: unknown)
        self.state = 'healthy'  # healthy | not_ready (answered 503) | unreachable | dropped
        self.failed_checks = 0  # health checks in a row that got no answer (only these drop a node)
        self.connect_failures = 0  # requests that got no answer from it (sent on to another node; all time)
        self.dropped_at: Optional[float] = None  # time.time() when it was dropped (while it is)
        self.unfinished = 0  # requests sent to it and not finished: queued plus running there
        self.unstarted = 0  # streamed ones among them that it has not begun answering (queued there)
        self.finished = 0
        self.failed = 0  # requests that failed on it (not counting the ones retried elsewhere)
        self.registered_at = time.time()
        self._samples = deque(maxlen=WINDOW)  # (seconds, requests in flight when it started)

    @property
    def healthy(self) -> bool:
        return self.state == 'healthy'

    def serves(self, model: Optional[str]) -> bool:
        return model is None or self.models is None or model in self.models

    def start(self) -> int:
        """A request is sent to it; returns the requests then in flight (itself included)."""
        self.unfinished += 1
        return self.unfinished

    def finish(self, seconds: float, in_flight: int = 1):
        """A request it had is answered in ``seconds``; ``in_flight``: what :meth:`start` returned."""
        self.unfinished = max(0, self.unfinished - 1)
        self.finished += 1
        self._samples.append((max(seconds, 1e-6), max(in_flight, 1)))

    def fail(self):
        """A request it had failed there (its stream broke)."""
        self.unfinished = max(0, self.unfinished - 1)
        self.failed += 1

    def drop(self):
        """A request it had ends without saying anything of the node (sent on elsewhere, client gone)."""
        self.unfinished = max(0, self.unfinished - 1)

    def speed(self) -> Optional[float]:
        """Requests a second it completes: by Little's law, the mean number in flight over the mean time
        one takes, over its last finished requests; the registered speed until there are any."""
        if not self._samples:
            return self.given_speed
        return sum(c for _, c in self._samples) / sum(s for s, _ in self._samples)

    def observed_latency(self) -> Optional[float]:
        """Mean seconds of its last finished requests (None before the first)."""
        if not self._samples:
            return None
        return sum(s for s, _ in self._samples) / len(self._samples)

    def status(self) -> dict:
        speed, lat = self.speed(), self.observed_latency()
        return {'url': self.url, 'models': self.models, 'state': self.state, 'healthy': self.healthy,
                'max_batch_size': self.max_batch_size, 'unfinished': self.unfinished, 'unstarted': self.unstarted,
                'finished': self.finished, 'failed': self.failed, 'failed_checks': self.failed_checks,
                'connect_failures': self.connect_failures, 'dropped_at': self.dropped_at,
                'speed': round(speed, 4) if speed is not None else None,
                'observed_latency': round(lat, 4) if lat is not None else None,
                'registered_at': self.registered_at}


class NodeTable:
    """url -> :class:`Node`, optionally mirrored to a JSON file."""

    def __init__(self, path: Optional[str] = None):
        self.nodes: Dict[str, Node] = {}
        self.path = path
        if path and os.path.exists(path):
            self._load(path)

    def add(self, url: str, models: Optional[List[str]] = None, speed: Optional[float] = None,
            max_batch_size: Optional[int] = None) -> Node:
        """A new node (healthy), or a known one with what is given updated (its state is not changed:
        whoever registers it again, the health check decides; see :meth:`set_state`)."""
        url = normalize_url(url)
        if speed is not None and not (isinstance(speed, (int, float)) and speed > 0):
            raise ValueError(f'speed must be a positive number of requests a second, got {speed!r}')
        if max_batch_size is not None and not (isinstance(max_batch_size, int) and max_batch_size >= 1):
            raise ValueError(f'max_batch_size must be an integer >= 1, got {max_batch_size!r}')
        node = self.nodes.get(url)
        if node is None:
            node = self.nodes[url] = Node(url, models, speed, max_batch_size)
            logger.warning('node added: %s (models: %s)', url, ', '.join(models) if models else 'any')
            self._save()
            return node
        before = (node.models, node.given_speed, node.max_batch_size)
        node.models = list(models) if models else node.models
        node.given_speed = speed if speed is not None else node.given_speed
        node.max_batch_size = max_batch_size if max_batch_size is not None else node.max_batch_size
        if (node.models, node.given_speed, node.max_batch_size) != before:
            logger.warning('node registered again: %s', url)
            self._save()
        return node

    def set_state(self, node: Node, state: str, why: str = '') -> bool:
        """Set a node's state (logged when it changes; the file records which nodes are dropped);
        True when it changed."""
        if state == node.state:
            return False
        old, node.state = node.state, state
        if state == 'dropped':
            node.dropped_at = time.time()
        elif old == 'dropped':
            node.dropped_at = None
        if state == 'healthy' and old in ('unreachable', 'dropped'):
            logger.warning('node %s is back (healthy)%s', node.url, f': {why}' if why else '')
        else:
            logger.warning('node %s is %s%s', node.url, state.replace('_', ' '), f' ({why})' if why else '')
        if 'dropped' in (old, state):
            self._save()
        return True

    def remove(self, url: str, why: str = 'removed') -> bool:
        try:
            url = normalize_url(url)
        except ValueError:
            return False
        node = self.nodes.pop(url, None)
        if node is None:
            return False
        logger.warning('node %s: %s', why, url)
        self._save()
        return True

    def get(self, url: str) -> Optional[Node]:
        return self.nodes.get(url)

    def candidates(self, model: Optional[str]) -> List[Node]:
        """The healthy nodes that serve ``model`` (None: any)."""
        return [n for n in self.nodes.values() if n.healthy and n.serves(model)]

    def model_names(self) -> List[str]:
        """The models the nodes serve (healthy ones first), each once."""
        names: List[str] = []
        for n in sorted(self.nodes.values(), key=lambda n: not n.healthy):
            for m in n.models or ():
                if m not in names:
                    names.append(m)
        return names

    def status(self) -> List[dict]:
        return [n.status() for n in self.nodes.values()]

    # ----------------------------------------------------------- the file
    def _save(self):
        if not self.path:
            return
        data = {'nodes': [{'url': n.url, 'models': n.models, 'speed': n.given_speed,
                           'max_batch_size': n.max_batch_size, 'dropped': n.state == 'dropped'}
                          for n in self.nodes.values()]}
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix='.nodes-', suffix='.json')
            with os.fdopen(fd, 'w') as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)  # whole or not at all, even if the proxy dies while writing
        except OSError as e:
            logger.warning('cannot write the node table to %s: %s', self.path, e)

    def _load(self, path: str):
        try:
            with open(path) as f:
                data = json.load(f)
            entries = data['nodes']
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f'cannot read the node table {path!r}: {e}') from None
        for e in entries:
            try:
                url = normalize_url(e['url'])
                batch = e.get('max_batch_size')
                node = Node(url, e.get('models'), e.get('speed'), batch if isinstance(batch, int) and batch >= 1
                            else None)
                if e.get('dropped'):  # still probed; the clock to forgetting it starts again
                    node.state, node.dropped_at = 'dropped', time.time()
                self.nodes[url] = node
            except (ValueError, KeyError, TypeError) as err:
                logger.warning('skipping an entry of %s: %s', path, err)
        if self.nodes:
            logger.warning('read %d node(s) from %s', len(self.nodes), path)
