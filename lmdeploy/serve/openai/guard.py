"""The ASGI guard in front of every route: API keys, readiness, the body size limit, error counting; and
whose sessions a request may reach (its key's)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .errors import error_body, send_json

if TYPE_CHECKING:
    from .state import ServerState

DEFAULT_MAX_BODY_BYTES = 16 << 20
_OPEN_PATHS = ('/health', '/metrics', '/openapi.json', '/docs', '/docs/oauth2-redirect', '/redoc')


def _bearer_key(authorization: str) -> Optional[str]:
    """The key of an ``Authorization: Bearer KEY`` header's value; None for another scheme."""
    scheme, _, key = authorization.partition(' ')
    return key.strip() if scheme.lower() == 'bearer' else None


def request_owner(state: ServerState, request) -> Optional[bytes]:
    """Whose sessions a request may reach: its API key's digest (the guard has checked the key); None on
    a server without keys, where only a session's token reaches it."""
    if not state.api_key_digests:
        return None
    auth = dict(request.scope.get('headers') or []).get(b'authorization', b'')  # the header the guard read
    return state.key_digest(_bearer_key(auth.decode('latin-1')))


class GuardMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched): API keys,
    readiness, the body size limit, and error counting."""

    def __init__(self, app, state: ServerState, max_body_bytes: int):
        self.app = app
        self.state = state
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope['type'] != 'http':
            return await self.app(scope, receive, send)
        metrics = self.state.metrics

        async def counting_send(message):
            if message['type'] == 'http.response.start' and message['status'] >= 400:
                metrics.http_errors.labels(str(message['status'])).inc()
            await send(message)

        path, method = scope['path'], scope['method']
        protected = (path.startswith('/v1/') or path == '/generate') and method != 'OPTIONS'
        headers = dict(scope.get('headers') or [])
        if protected and self.state.api_key_digests:
            auth = headers.get(b'authorization', b'').decode('latin-1')
            key = _bearer_key(auth)
            if key is None or not self.state.key_ok(key):
                msg = 'missing API key' if not auth else 'invalid API key'
                return await send_json(counting_send, 401, error_body(
                    401, f'{msg}: send "Authorization: Bearer YOUR_KEY"', 'invalid_api_key'),
                    [(b'www-authenticate', b'Bearer')])
        if protected:
            why = self.state.not_ready()
            if why is not None:
                return await send_json(counting_send, 503, error_body(503, why[0], why[1]),
                                        [(b'retry-after', b'5')] if why[1] == 'engine_not_ready' else [])
        limit = self.max_body_bytes
        too_big = error_body(413, f'the request body is larger than {limit} bytes', 'request_too_large')
        length = headers.get(b'content-length')
        if length is not None and length.isdigit() and int(length) > limit:
            return await send_json(counting_send, 413, too_big, [(b'connection', b'close')])
        if method not in ('POST', 'PUT', 'PATCH'):
            return await self.app(scope, receive, counting_send)
        body = bytearray()
        while True:
            message = await receive()
            if message['type'] == 'http.disconnect':
                return
            body += message.get('body', b'')
            if len(body) > limit:
                return await send_json(counting_send, 413, too_big, [(b'connection', b'close')])
            if not message.get('more_body', False):
                break
        content_type = headers.get(b'content-type', b'')
        if b'json' not in content_type and bytes(body[:64]).lstrip()[:1] in (b'{', b'['):
            # `curl -d '{...}'` sends JSON as a form: read it as the JSON it is
            scope = dict(scope)
            scope['headers'] = [(k, v) for k, v in scope['headers'] if k != b'content-type'] + [
                (b'content-type', b'application/json')]
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {'type': 'http.request', 'body': bytes(body), 'more_body': False}
            return await receive()

        await self.app(scope, replay, counting_send)
