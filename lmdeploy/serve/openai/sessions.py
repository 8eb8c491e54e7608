"""Client session ids mapped onto engine sessions, and leasing them for one request."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from .errors import APIError

if TYPE_CHECKING:
    from .state import ServerState


@dataclass
class _Session:
    internal_id: int  # the engine's session id
    turns: int = 0  # finished interactive turns (the engine holds their cache)
    busy: bool = False


class _Sessions:
    """Client session ids -> engine session ids.

    Client ids live in their own namespace, so a client choosing an id never
    collides with ids the server picks; an entry exists while a named request
    runs, and between the turns of an interactive session."""

    def __init__(self):
        self.by_client: Dict[int, _Session] = {}
        self._auto = 1 << 31

    def auto_id(self) -> int:
        while self._auto in self.by_client:
            self._auto += 1
        self._auto += 1
        return self._auto - 1


def _begin_session(state: ServerState, client_id: Optional[int],
                   exclusive: bool = False) -> Tuple[Optional[int], _Session]:
    """Lease the engine session for a request; a named one must not be busy
    (``exclusive``: must not exist at all, e.g. a live interactive session)."""
    gateway = state.gateway
    if client_id is None or client_id == -1:
        return None, _Session(gateway.next_session_id(), busy=True)
    sess = state.sessions.by_client.get(client_id)
    if sess is not None and (sess.busy or exclusive):
        what = 'busy with another request' if sess.busy else 'an interactive session (continue it with /generate)'
        raise APIError(400, f'session {client_id} is {what}', 'session_busy', 'session_id')
    if sess is None:
        sess = _Session(gateway.next_session_id())
        state.sessions.by_client[client_id] = sess
    sess.busy = True
    return client_id, sess


def _end_lease(state: ServerState, client_id: Optional[int], sess: _Session, keep: bool, failed: bool):
    """After a request: keep an interactive session, or forget it (freeing its cache)."""
    sess.busy = False
    if keep and not failed:
        sess.turns += 1
        return
    if sess.turns > 0 or keep:  # the engine may hold the session's cache: free it
        state.gateway.end_session(sess.internal_id)
    if client_id is not None and state.sessions.by_client.get(client_id) is sess:
        del state.sessions.by_client[client_id]


class _Lease:
    """One request's hold on an engine session (``_begin_session``), ended
    exactly once: an interactive session is kept for its next turn only if
    the request did not fail."""

    def __init__(self, state: ServerState, client_id: Optional[int], exclusive: bool = False, keep: bool = False):
        self.state = state
        self.client_id, self.session = _begin_session(state, client_id, exclusive)
        self.keep = keep
        self._ended = False

    @property
    def internal_id(self) -> int:
        return self.session.internal_id

    def end(self, failed: bool):
        if not self._ended:
            self._ended = True
            _end_lease(self.state, self.client_id, self.session, self.keep, failed)
