"""uvicorn that drains on SIGTERM / SIGINT, and :class:`BackgroundServer` (an app on a thread)."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Optional

logger = logging.getLogger('lmdeploy.serve')


def _make_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, but SIGTERM / SIGINT mark the app as draining (new requests:
        503) and the process is not re-killed by the signal afterwards, so
        :func:`serve` returns 0 once running requests have finished."""

        def __init__(self, config, on_exit=None):
            super().__init__(config)
            self._on_exit = on_exit

        def request_exit(self):
            if self._on_exit is not None:
                self._on_exit()
            self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def handle(sig, frame):
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                logger.warning('received %s: draining (no new requests; running ones finish)',
                               signal.Signals(sig).name)
                self.request_exit()

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
        self.server = _make_server_class()(config, on_exit=(lambda: setattr(state, 'draining', True))
                                           if state is not None else None)
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
