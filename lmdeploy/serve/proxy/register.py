"""An api_server joining and leaving a proxy (``lmdeploy serve api_server --proxy-url URL``).

The server registers once it listens (so the proxy's first request finds it up), retrying for a
while if the proxy is not up yet; a registration that fails in the end is a warning, never a reason
to stop serving. While it serves it registers again every ``heartbeat`` seconds, so a proxy that
started later, restarted without its state file, or dropped and forgot it, has it back within that
time (a node removed by hand is not brought back this way: the proxy ignores its heartbeats). It
deregisters when it starts draining (SIGTERM / SIGINT), so the proxy stops sending it new requests
while the running ones finish. Its registration says its engine's batch size, which is how many
requests the proxy keeps at it. Only ``httpx`` (synchronous) is needed.

The proxy's key comes from ``api_key``, else ``$LMDEPLOY_PROXY_API_KEY``. The URL the node gives
the proxy is ``node_url`` if set, else built from the host and port it binds; a wildcard host
(0.0.0.0, ::) becomes the address this machine uses to reach the proxy.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import List, Optional
from urllib.parse import urlsplit

logger = logging.getLogger('lmdeploy.serve')

ENV_KEY = 'LMDEPLOY_PROXY_API_KEY'
DEFAULT_HEARTBEAT = 30.0  # seconds between a live node's registrations


def own_url(server_name: str, server_port: int, proxy_url: str, scheme: str = 'http') -> str:
    """The URL the proxy can reach this server at."""
    host = server_name
    if host in ('', '0.0.0.0', '::', '[::]'):
        target = urlsplit(proxy_url)
        try:  # no packet is sent: connecting a UDP socket only picks the outgoing interface
            family = socket.AF_INET6 if host in ('::', '[::]') and ':' in (target.hostname or '') else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target.hostname or '127.0.0.1', target.port or 80))
                host = s.getsockname()[0]
        except OSError:
            host = socket.gethostbyname(socket.gethostname())
    if ':' in host and not host.startswith('['):
        host = f'[{host}]'
    return f'{scheme}://{host}:{server_port}'


class ProxyLink:
    """This server's entry in a proxy's node table."""

    def __init__(self, proxy_url: str, node_url: str, models: Optional[List[str]] = None,
                 api_key: Optional[str] = None, timeout: float = 5.0, max_batch_size: Optional[int] = None,
                 heartbeat: float = DEFAULT_HEARTBEAT):
        if not proxy_url.startswith(('http://', 'https://')):
            raise ValueError(f'--proxy-url must be http(s)://HOST:PORT, got {proxy_url!r}')
        self.proxy_url = proxy_url.rstrip('/')
        self.node_url = node_url
        self.models = models
        self.api_key = api_key if api_key is not None else os.environ.get(ENV_KEY) or None
        self.timeout = timeout
        self.max_batch_size = max_batch_size
        self.heartbeat = heartbeat  # seconds between registrations while serving; 0: register once
        self.registered = False
        self._left = threading.Event()
        self._lock = threading.Lock()
        self._posting = threading.Lock()  # one registration or removal at a time, in order
        self._leaving: Optional[threading.Thread] = None
        self._beat_error: Optional[str] = None  # what the last heartbeat got, if it was not a 200

    def _post(self, path: str, body: dict):
        import httpx
        headers = {'Authorization': f'Bearer {self.api_key}'} if self.api_key else {}
        return httpx.post(self.proxy_url + path, json=body, headers=headers, timeout=self.timeout, trust_env=False)

    def _add(self, heartbeat: bool):
        """POST /nodes/add unless the server is leaving (then None); a 200 marks it registered."""
        body = {'url': self.node_url, 'models': self.models}
        if self.max_batch_size:
            body['max_batch_size'] = self.max_batch_size
        if heartbeat:
            body['heartbeat'] = True
        with self._posting:
            if self._left.is_set():
                return None
            r = self._post('/nodes/add', body)
            if r.status_code == 200:
                self.registered = True
            return r

    def _try_add(self, heartbeat: bool):
        """(the proxy's answer, or None when the server is leaving or the request failed; why it was not a 200)."""
        import httpx
        try:
            r = self._add(heartbeat)
        except httpx.HTTPError as e:
            return None, f'{type(e).__name__}: {e}'
        return r, ('' if r is None or r.status_code == 200 else f'HTTP {r.status_code}: {r.text[:300]}')

    def register(self, attempts: int = 10, delay: float = 1.0) -> bool:
        """Add this node to the proxy; True when it answered 200. Stops early once :meth:`deregister` ran."""
        why = ''
        for i in range(attempts):
            r, why = self._try_add(heartbeat=False)
            if r is None and not why:
                return False
            if r is not None and r.status_code == 200:
                logger.warning('registered with the proxy %s as %s', self.proxy_url, self.node_url)
                return True
            if r is not None and r.status_code in (400, 401, 403, 404, 422):
                break  # it will not change by asking again
            if i + 1 < attempts and self._left.wait(min(delay * 2 ** i, 10.0)):
                return False
        if self._left.is_set():
            return False
        logger.warning('could not register with the proxy %s as %s (%s); serving anyway, but the proxy does not '
                       'know this server (add it with POST %s/nodes/add)%s', self.proxy_url, self.node_url, why,
                       self.proxy_url, f'; trying again every {self.heartbeat:g} s' if self.heartbeat else '')
        self._beat_error = why
        return False

    def beat(self) -> bool:
        """Register again (quietly: a change is logged once); True when the proxy answered 200."""
        r, why = self._try_add(heartbeat=True)
        if r is None and not why:
            return False
        if r is not None and r.status_code == 200:
            if self._beat_error is not None:
                logger.warning('registered with the proxy %s as %s again', self.proxy_url, self.node_url)
                self._beat_error = None
            return True
        if self._beat_error is None:
            logger.warning('could not register again with the proxy %s (%s); trying every %g s', self.proxy_url,
                           why, self.heartbeat)
        self._beat_error = why
        return False

    def keep_registered(self):
        """:meth:`beat` every ``heartbeat`` seconds until :meth:`deregister`."""
        while self.heartbeat and not self._left.wait(self.heartbeat):
            self.beat()

    def register_when_listening(self, server, poll: float = 0.05) -> threading.Thread:
        """Register from a thread once ``server`` (a uvicorn server) has started listening, then keep
        registering every ``heartbeat`` seconds until the server leaves."""

        def run():
            while not getattr(server, 'started', False):
                if self._left.wait(poll) or getattr(server, 'should_exit', False):
                    return
            self.register()
            self.keep_registered()

        t = threading.Thread(target=run, name='lmdeploy-proxy-register', daemon=True)
        t.start()
        return t

    def deregister(self) -> bool:
        """Take this node out of the proxy's table (once; later calls do nothing)."""
        with self._lock:
            if self._left.is_set():
                return False
            self._left.set()
        with self._posting:  # after a registration in flight, never before it
            was, self.registered = self.registered, False
            if not was:
                return False
            return self._post_quietly('/nodes/remove')

    def _post_quietly(self, path: str) -> bool:
        import httpx
        try:
            r = self._post(path, {'url': self.node_url})
        except httpx.HTTPError as e:
            logger.warning('could not deregister from the proxy %s: %s', self.proxy_url, e)
            return False
        if r.status_code != 200:
            logger.warning('could not deregister from the proxy %s: HTTP %d %s', self.proxy_url, r.status_code,
                           r.text[:200])
            return False
        logger.warning('deregistered from the proxy %s', self.proxy_url)
        return True

    def deregister_in_background(self) -> threading.Thread:
        """:meth:`deregister` from a thread (a signal handler must not wait on the network)."""
        if self._leaving is None:  # a second signal does not start a second one
            self._leaving = threading.Thread(target=self.deregister, name='lmdeploy-proxy-deregister', daemon=True)
            self._leaving.start()
        return self._leaving

    def leave(self, timeout: float = 10.0):
        """Deregistered for sure when this returns (or ``timeout`` passed): at the server's exit."""
        if self._leaving is not None:
            self._leaving.join(timeout)
        else:
            self.deregister()
