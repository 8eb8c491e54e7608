"""OpenAI-shaped errors: the APIError handlers raise, and how exceptions become error responses."""
from __future__ import annotations

import json
import logging
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger('lmdeploy.serve')

_BODY_PARSE_ERROR = 'There was an error parsing the body'  # FastAPI's detail when json.loads raises
_CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never received
_TYPES = {400: 'invalid_request_error', 401: 'authentication_error', 404: 'invalid_request_error',
          405: 'invalid_request_error', 413: 'invalid_request_error', 422: 'invalid_request_error',
          500: 'internal_server_error', 503: 'service_unavailable_error'}
# pydantic error types that mean "a value out of range" (code invalid_value; the rest are invalid_body)
_VALUE_ERRORS = {'greater_than', 'greater_than_equal', 'less_than', 'less_than_equal', 'multiple_of',
                 'finite_number', 'too_short', 'too_long', 'string_too_short', 'string_too_long', 'value_error',
                 'literal_error', 'enum', 'union_tag_invalid', 'string_pattern_mismatch', 'invalid_format_type'}


def _validation_code(errors: List[Dict[str, Any]]) -> str:
    """invalid_value when every field in error had the right shape but a bad value (for a union, some
    variant's value check failed); invalid_body when a field is missing or of the wrong type, or the body
    is not JSON. Both are answered with 400, as OpenAI answers them."""
    by_field: Dict[Any, List[str]] = {}
    for e in errors:
        loc = [x for x in e.get('loc', ()) if x != 'body']
        by_field.setdefault(loc[0] if loc else None, []).append(e.get('type'))
    if not by_field:
        return 'invalid_body'
    for field_name, types in by_field.items():
        if field_name is None or not any(t in _VALUE_ERRORS for t in types):
            return 'invalid_body'
    return 'invalid_value'


def _describe(e: Dict[str, Any]) -> Tuple[str, Optional[str]]:
    """One validation error in words, and the parameter it names (None for the body as a whole)."""
    if e.get('type') == 'json_invalid':
        where = [x for x in e.get('loc', ()) if isinstance(x, int)]
        at = f' at character {where[0]}' if where else ''
        return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))}{at})", None
    loc = _location(e)
    if e.get('type') == 'missing':
        return f"missing required parameter: '{'.'.join(loc)}'", '.'.join(loc) or None
    if not loc:
        return f"the request body: {e.get('msg')} (a JSON object is expected)", None
    return f"{'.'.join(loc)}: {e.get('msg')}", '.'.join(loc)


def _location(e: Dict[str, Any]) -> List[str]:
    """Where in the body an error is, as the client wrote it: without 'body' and without the tags of the
    unions read by JSON type (``messages.0.role``, not ``messages.array.0.role``)."""
    from .protocol import UNION_TAGS
    return [str(x) for x in e.get('loc', ()) if x != 'body' and x not in UNION_TAGS]


def _unparsable_body(cause: Optional[BaseException]) -> str:
    """Why a body the JSON reader gave up on (not a syntax error: those are RequestValidationError) is not
    one: bytes that are not UTF-8, a number too long to read, arrays or objects nested too deeply."""
    if isinstance(cause, UnicodeDecodeError):
        return (f'the request body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at position '
                f'{cause.start}); send JSON encoded as UTF-8')
    if isinstance(cause, RecursionError):
        return 'the request body nests arrays or objects too deeply to be read'
    if isinstance(cause, ValueError) and 'digits' in str(cause):
        return (f'the request body holds a number with too many digits to be read (at most '
                f'{sys.get_int_max_str_digits()})')
    return f'the request body cannot be read as JSON ({type(cause).__name__ if cause else "unknown error"})'


class APIError(Exception):
    """Raised anywhere in a handler: becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or _TYPES.get(status, 'invalid_request_error')


def error_body(status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
               type: Optional[str] = None) -> Dict[str, Any]:
    return {'error': {'message': message, 'type': type or _TYPES.get(status, 'invalid_request_error'),
                      'param': param, 'code': code}}


def error_response(status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
                   headers: Optional[Dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


async def send_json(send, status: int, body: Dict[str, Any], headers: Sequence[Tuple[bytes, bytes]] = ()):
    data = json.dumps(body).encode()
    await send({'type': 'http.response.start', 'status': status,
                'headers': [(b'content-type', b'application/json'), (b'content-length', str(len(data)).encode()),
                            *headers]})
    await send({'type': 'http.response.body', 'body': data})


class ClientGone(Exception):
    pass


def install_error_handlers(app: FastAPI):
    """Answer every exception a handler lets out with an OpenAI-shaped error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.status, exc.message, exc.code, exc.param, exc.type),
                            status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        parts, param = [], None
        for e in errors[:5]:
            text, where = _describe(e)
            param = param or where
            parts.append(text)
        more = f' (and {len(errors) - 5} more)' if len(errors) > 5 else ''
        return error_response(400, '; '.join(parts) + more, _validation_code(errors), param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: 'not_found', 405: 'method_not_allowed', 413: 'request_too_large'}.get(
            exc.status_code, 'invalid_request' if exc.status_code < 500 else 'internal_error')  # never null
        if exc.status_code == 404:
            msg = f'{request.method} {request.url.path} not found'
        elif exc.status_code == 405:
            msg = f'method {request.method} is not allowed on {request.url.path}'
        elif exc.status_code == 400 and exc.detail == _BODY_PARSE_ERROR:  # FastAPI's words for its reader's failure
            msg, code = _unparsable_body(exc.__cause__), 'invalid_body'
        else:
            msg = str(exc.detail)
        return error_response(exc.status_code, msg, code, headers=getattr(exc, 'headers', None))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        return Response(status_code=_CLIENT_GONE)  # nobody reads it; logged and counted

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception('unhandled error')
        return error_response(500, f'internal error: {type(exc).__name__}', 'internal_error')
