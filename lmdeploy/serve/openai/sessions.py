"""Sessions, each owned by the client that made it, mapped onto engine sessions; leasing one for a request.

A session is reached by its token (handed out by the server, unguessable) or, on a server with API keys, by
the client's own id within its key's namespace. Another owner's session is never found: a request naming it
is answered exactly as one naming a session that does not exist, and each session has an engine id of its
own, so A's 4242 and B's 4242 never share a KV cache."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from .errors import APIError

if TYPE_CHECKING:
    from .state import ServerState


def _new_token() -> str:
    return secrets.token_urlsafe(24)  # 192 random bits


@dataclass
class _Session:
    internal_id: int  # the engine's session id
    client_id: Optional[int] = None  # the id its owner names it by (its own, or one the server picked)
    owner: Optional[bytes] = None  # the API key's digest; None on a server without keys
    token: str = field(default_factory=_new_token)
    turns: int = 0  # finished interactive turns (the engine holds their cache)
    busy: bool = False


class Sessions:
    """The live sessions: an entry exists while a request runs, and between the turns of an interactive
    session. Found by token, or by (owner, client id) where the owner has an identity (an API key): without
    keys a client's own id is guessable, so it alone never reaches a session."""

    def __init__(self):
        self._by_token: Dict[str, _Session] = {}
        self._by_name: Dict[Tuple[bytes, int], _Session] = {}
        self._auto = 1 << 31  # server-picked ids, above those clients usually pick

    def __len__(self) -> int:
        return len(self._by_token)

    def find(self, owner: Optional[bytes], client_id: Optional[int], token: Optional[str] = None) -> \
            Optional[_Session]:
        """The owner's session named by ``token`` (and ``client_id``, unless None or -1), else by
        ``client_id``; None for one that does not exist or is another owner's."""
        named = client_id is not None and client_id != -1
        if token is not None:
            sess = self._by_token.get(token)
            if sess is None or sess.owner != owner or (named and sess.client_id != client_id):
                return None
            return sess
        if owner is None or not named:
            return None
        return self._by_name.get((owner, client_id))

    def add(self, sess: _Session):
        self._by_token[sess.token] = sess
        if sess.owner is not None and sess.client_id is not None:
            self._by_name[(sess.owner, sess.client_id)] = sess

    def remove(self, sess: _Session):
        if self._by_token.get(sess.token) is sess:
            del self._by_token[sess.token]
        key = (sess.owner, sess.client_id)
        if self._by_name.get(key) is sess:
            del self._by_name[key]

    def end_all(self, gateway):
        """Forget every session and free its cache (a clean-up: a running turn is aborted)."""
        for sess in list(self._by_token.values()):
            gateway.end_session(sess.internal_id)
        self._by_token.clear()
        self._by_name.clear()

    def auto_id(self, owner: Optional[bytes]) -> int:
        """A client id for a session the client did not name (unused in the owner's namespace)."""
        while owner is not None and (owner, self._auto) in self._by_name:
            self._auto += 1
        self._auto += 1
        return self._auto - 1


def _begin_session(state: ServerState, owner: Optional[bytes], client_id: Optional[int], token: Optional[str],
                   exclusive: bool = False) -> _Session:
    """Lease the engine session for a request; an existing one must not be busy (``exclusive``: must not
    exist at all, e.g. a live interactive session). A ``token`` must name a session of the owner's."""
    gateway = state.gateway
    if (client_id is None or client_id == -1) and token is None:
        return _Session(gateway.next_session_id(), busy=True)  # unnamed: nobody can reach it
    sess = state.sessions.find(owner, client_id, token)
    if sess is None and token is not None:
        raise session_not_found()
    if sess is not None and (sess.busy or exclusive):
        what = 'busy with another request' if sess.busy else 'an interactive session (continue it with /generate)'
        raise APIError(400, f'session {sess.client_id} is {what}', 'session_busy', 'session_id')
    if sess is None:
        sess = _Session(gateway.next_session_id(), client_id, owner)
        state.sessions.add(sess)
    sess.busy = True
    return sess


def session_not_found() -> APIError:
    # the same words whether the session ended or is another client's: they must not tell the two apart
    return APIError(404, 'no such session: it has ended, or the session_token is not one this server gave you',
                    'session_not_found', 'session_token')


def _end_lease(state: ServerState, sess: _Session, keep: bool, failed: bool):
    """After a request: keep an interactive session, or forget it (freeing its cache)."""
    sess.busy = False
    if keep and not failed:
        sess.turns += 1
        return
    if sess.turns > 0 or keep:  # the engine may hold the session's cache: free it
        state.gateway.end_session(sess.internal_id)
    state.sessions.remove(sess)


def end_session(state: ServerState, sess: _Session):
    """A client's end of its session: forget it and free its cache (the engine aborts a running turn)."""
    state.sessions.remove(sess)
    state.gateway.end_session(sess.internal_id)


class Lease:
    """One request's hold on an engine session (``_begin_session``), ended
    exactly once: an interactive session is kept for its next turn only if
    the request did not fail."""

    def __init__(self, state: ServerState, client_id: Optional[int], owner: Optional[bytes] = None,
                 token: Optional[str] = None, exclusive: bool = False, keep: bool = False):
        self.state = state
        self.session = _begin_session(state, owner, client_id, token, exclusive)
        self.keep = keep
        self._ended = False

    @property
    def internal_id(self) -> int:
        return self.session.internal_id

    @property
    def client_id(self) -> Optional[int]:
        return self.session.client_id

    def end(self, failed: bool):
        if not self._ended:
            self._ended = True
            _end_lease(self.state, self.session, self.keep, failed)
