"""uvicorn that drains on SIGTERM / SIGINT, the server's socket bound before the model loads, and
:class:`BackgroundServer` (an app on a thread)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger('lmdeploy.serve')

CUT_GRACE_S = 5.0  # after running requests are cut short: for their responses to end (error event, [DONE])
FINAL_GRACE_S = 2.0  # then uvicorn's own wait before it cancels what is left


class PortInUseError(RuntimeError):
    """The server's address cannot be bound (in use, not this machine's, no permission)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening, so connections are refused until the server is up).

    Bound first, before the model loads: a port in use fails in a second with a clear message, not after
    minutes of loading, and nothing can take the port meanwhile."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise PortInUseError(f'cannot serve on {host}:{port}: the host name does not resolve ({e.strerror})') from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a server just stopped: TIME_WAIT is fine)
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = '; is another server running there? (--server-port picks another port)' \
            if e.errno in (98, 48, 10048) else ''
        raise PortInUseError(f'cannot serve on {host}:{port}: {e.strerror or e}{hint}') from None
    return sock


class _QuietCancel(logging.Filter):
    """A request cancelled because the server is stopping is no error: one line instead of uvicorn's
    "Exception in ASGI application" traceback of a CancelledError."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            record.msg, record.args, record.exc_info, record.exc_text = 'a request was cancelled at shutdown', (), \
                None, None
            record.levelno, record.levelname = logging.WARNING, 'WARNING'
        return True


def make_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, but SIGTERM / SIGINT drain, and the process is not re-killed by the signal afterwards,
        so :func:`serve` returns 0 once running requests have finished.

        With ``on_exit`` (the app answers 503 from then on: new requests and /health) the listener stays
        open while draining, so clients are told why instead of being refused; the drain ends when no
        request runs, or at ``config.timeout_graceful_shutdown`` (None: no limit) or a second signal, when
        ``on_cut`` ends what still runs (its responses end well-formed) and the server stops a moment later.
        A third signal stops at once. Without ``on_exit``, uvicorn's own drain: the listener closes at once.
        ``on_listening(server)``: called once the socket listens."""

        def __init__(self, config, on_exit: Optional[Callable[[], None]] = None,
                     on_cut: Optional[Callable[[], None]] = None,
                     on_listening: Optional[Callable[['DrainingServer'], None]] = None):
            super().__init__(config)
            self._on_exit = on_exit
            self._on_cut = on_cut
            self._on_listening = on_listening
            self._signals = 0
            self._deadline: Optional[float] = None  # while draining: when running requests are cut short
            self._cut_at: Optional[float] = None

        # ------------------------------------------------------------ drain
        def request_exit(self, hurry: bool = False):
            """Start draining (``hurry``: cut what still runs now)."""
            if self._on_exit is None:
                self.should_exit = True
                return
            now = time.monotonic()
            if self._deadline is None:
                self._on_exit()
                limit = self.config.timeout_graceful_shutdown
                self._deadline = now + (limit if limit is not None else float('inf'))
            if hurry:
                self._deadline = min(self._deadline, now)

        @property
        def draining(self) -> bool:
            return self._deadline is not None

        def _drain_tick(self):
            now = time.monotonic()
            if not self.server_state.tasks:  # nothing runs (an idle kept-alive connection is no task)
                self.should_exit = True
            elif self._cut_at is None and now >= self._deadline:
                self._cut_at = now
                logger.warning('drain: cutting %d running request(s) short', len(self.server_state.tasks))
                if self._on_cut is not None:
                    self._on_cut()
            elif self._cut_at is not None and now - self._cut_at >= CUT_GRACE_S:
                self.config.timeout_graceful_shutdown = FINAL_GRACE_S
                self.should_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self._deadline is not None and not self.should_exit:
                self._drain_tick()
            return await super().on_tick(counter)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and self._on_listening is not None:
                self._on_listening(self)

        async def shutdown(self, sockets=None):
            # (what uvicorn still has to cancel at its deadline was running when the server had to stop)
            uv_log = logging.getLogger('uvicorn.error')
            if not any(isinstance(f, _QuietCancel) for f in uv_log.filters):
                uv_log.addFilter(_QuietCancel())
            await super().shutdown(sockets=sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def handle(sig, frame):
                self._signals += 1
                name = signal.Signals(sig).name
                if self._signals == 1:
                    logger.warning('received %s: draining (no new requests, /health answers 503; running ones '
                                   'finish%s; a second signal cuts them short)', name,
                                   '' if self.config.timeout_graceful_shutdown is None
                                   else f', for up to {self.config.timeout_graceful_shutdown:g} s')
                    self.request_exit()
                elif self._signals == 2 and self._on_exit is not None:
                    logger.warning('received %s again: ending the running requests now', name)
                    self.request_exit(hurry=True)
                else:
                    logger.warning('received %s again: stopping now', name)
                    self.should_exit = self.force_exit = True

            originals = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    return DrainingServer


class BackgroundServer:
    """Run an app with uvicorn on a background thread (tests, notebooks).

    ``with BackgroundServer(app) as srv: httpx.get(srv.url + '/health')``;
    ``port=0`` picks a free port. :meth:`stop` drains like SIGTERM does.
    """

    def __init__(self, app, host: str = '127.0.0.1', port: int = 0, drain_timeout: Optional[float] = 30,
                 log_level: str = 'warning', **config_kwargs):
        import uvicorn
        self.app = app
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan='off',
                                timeout_graceful_shutdown=drain_timeout, **config_kwargs)
        state = getattr(app.state, 'lmdeploy', None)
        self.server = make_server_class()(config, on_exit=(lambda: setattr(state, 'draining', True))
                                           if state is not None else None,
                                           on_cut=state.cut_running if state is not None else None)
        self.host = host
        self.port = port
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def _run(self):
        try:
            self.server.run()
        except BaseException as e:  # SystemExit from a failed bind included
            self._error = e

    def start(self, timeout: float = 60) -> 'BackgroundServer':
        self._thread = threading.Thread(target=self._run, name='lmdeploy-api-server', daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f'the server did not start: {self._error!r}')
            if time.monotonic() > deadline:
                raise TimeoutError('the server did not start in time')
            time.sleep(0.02)
        sockets = [s for srv in self.server.servers for s in srv.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f'http://{self.host}:{self.port}'

    def stop(self, timeout: float = 60):
        if self._thread is None:
            return
        self.server.request_exit()
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
