"""The chat page's backend for a running ``lmdeploy serve api_server``: its native ``/generate`` endpoint,
which keeps an interactive session's KV cache between turns under a client-chosen session id, streams
newline-delimited JSON, and takes ``cancel`` / ``end_session`` requests for the same id. The session's
token (in every answer) goes with each later request: it is what reaches the session (a server without API
keys knows no client by its id alone)."""
from __future__ import annotations

import json
import logging
import secrets
import threading
from typing import Iterator, Optional

from .backend import ChatBackend, ChatSession, ChatSettings

logger = logging.getLogger('lmdeploy')


class RemoteBackend(ChatBackend):

    def __init__(self, url: str, api_key: Optional[str] = None, timeout: float = 600.0):
        import httpx
        self.url = url.rstrip('/')
        headers = {'Authorization': f'Bearer {api_key}'} if api_key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=10))
        self._lock = threading.Lock()  # a session's token and pending request: stop / reset race the stream

    def check(self):
        """Fail early, with the reason, when nothing serves at the URL."""
        import httpx
        try:
            r = self._client.get('/v1/models')
        except httpx.HTTPError as e:
            raise RuntimeError(f'cannot reach the api_server at {self.url}: {e}') from e
        if r.status_code != 200:
            raise RuntimeError(f'{self.url}/v1/models answered {r.status_code}: {r.text[:200]}')
        return [m['id'] for m in r.json().get('data', [])]

    def stream(self, session: ChatSession, message: str, settings: ChatSettings) -> Iterator[str]:
        import httpx
        settings.check()
        if session.generating:
            raise ValueError('this conversation is already generating an answer')
        if session.session_id is None:  # ids in the server's client namespace: random, so tabs never collide
            session.session_id = secrets.randbelow(1 << 30) + 1
        first = session.turns == 0
        body = dict(prompt=self.turn_messages(message, settings, first), session_id=session.session_id,
                    interactive_mode=True, stream=True, request_output_len=settings.max_new_tokens,
                    temperature=settings.temperature, top_p=settings.top_p, top_k=0)
        if session.session_token is not None:
            body['session_token'] = session.session_token
        session.generating, session.error, finished = True, None, False
        session.pending = None
        sid, token = session.session_id, session.session_token
        reason: Optional[str] = None
        try:
            try:
                for data in self._generate(body):
                    if 'error' in data:
                        reason, session.error = 'error', _error_text(data)
                        break
                    if token is None and data.get('session_token'):
                        token = data['session_token']
                        with self._lock:
                            pending, session.pending = session.pending, None
                            if pending != 'end_session':
                                session.session_token = token
                        if pending:  # stop / reset came before the first answer: send it now
                            self._post({'session_id': sid, 'session_token': token, pending: True})
                    session.input_tokens = data.get('input_tokens', session.input_tokens)
                    session.generated_tokens = data.get('tokens', session.generated_tokens)
                    reason = data.get('finish_reason') or reason
                    if data.get('text'):
                        yield data['text']
            except (httpx.HTTPError, ValueError) as e:  # the server went away, or answered outside its API
                reason, session.error = 'error', f'the api_server at {self.url} failed: {type(e).__name__}: {e}'
            finished = True
        finally:
            session.generating = False
            session.finish_reason = reason if finished else (reason or 'abort')
            # a refused turn, or a stream closed early (the server then ends the session): start over
            if reason == 'error' or session.error or not finished:
                self._forget(session)
            else:
                session.turns += 1

    def _generate(self, body) -> Iterator[dict]:
        """``/generate``'s streamed lines, parsed; a refused request as one ``{'error': ...}``."""
        with self._client.stream('POST', '/generate', json=body) as r:
            if r.status_code != 200:
                r.read()
                try:
                    data = json.loads(r.text)
                except ValueError:
                    data = {}
                yield data if isinstance(data, dict) and 'error' in data else \
                    {'error': {'message': f'HTTP {r.status_code}: {r.text[:200]}'}}
                return
            for line in r.iter_lines():
                if line.strip():
                    yield json.loads(line)

    def stop(self, session: ChatSession):
        with self._lock:
            if session.session_token is None:  # the turn has no answer yet: stream() cancels once it does
                session.pending = 'cancel' if session.generating else None
                return
        self._post({'session_id': session.session_id, 'session_token': session.session_token, 'cancel': True})

    def reset(self, session: ChatSession):
        with self._lock:
            sid, token = session.session_id, session.session_token
            if token is None and session.generating:  # no answer yet: stream() ends the session once it has one
                session.pending = 'end_session'
            self._forget(session)
        if token is not None:
            self._post({'session_id': sid, 'session_token': token, 'end_session': True})

    @staticmethod
    def _forget(session: ChatSession):
        session.session_id, session.session_token, session.turns = None, None, 0

    def _post(self, body):
        import httpx
        try:
            self._client.post('/generate', json=body)
        except httpx.HTTPError as e:  # nothing to free on a server that is gone; say so in the log
            logger.warning('api_server %s: %s failed: %s', self.url, list(body)[-1], e)

    def close(self):
        self._client.close()


def _error_text(data: dict) -> str:
    err = data.get('error')
    return str(err.get('message', err)) if isinstance(err, dict) else str(err)
