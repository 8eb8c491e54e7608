"""A small synchronous client for lmdeploy's API server (needs only ``httpx``).

.. code-block:: python

    from lmdeploy.serve.client import APIClient

    client = APIClient('http://127.0.0.1:23333', api_key=None)
    model = client.available_models[0]
    for item in client.chat_completions_v1(model, [{'role': 'user', 'content': 'Hi'}]):
        print(item['choices'][0]['message']['content'])
    for item in client.chat_completions_v1(model, 'Tell me a story', stream=True, max_tokens=64):
        print(item['choices'][0]['delta'].get('content') or '', end='')
    # native API, interactive session: the server keeps the KV cache between turns
    for item in client.generate('My name is Bob.', session_id=7, interactive_mode=True):
        print(item['text'])
    print(client.generate_text('What is my name?', session_id=7, interactive_mode=True))
    client.end_session(7)

A session belongs to the client that made it. Each ``/generate`` answer
carries the session's ``session_token``; this client keeps it per session_id
and sends it back with the next turn, ``cancel`` and ``end_session``, which
is what reaches the session on a server without API keys (with keys, the
session_id under the same key does too). Another client's session answers as
one that does not exist.

As in LMDeploy's own ``APIClient``, the ``*_v1`` methods and
:meth:`APIClient.generate` are generators: they yield one dict (the whole
response) or, with ``stream=True``, one dict per streamed chunk. Errors raise
:class:`APIClientError` carrying the server's OpenAI-shaped error.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List, Optional, Union

__all__ = ['APIClient', 'APIClientError']


class APIClientError(RuntimeError):
    """An error answer of the server: HTTP status plus ``{"message", "type", "code"}``."""

    def __init__(self, status: int, message: str, type: Optional[str] = None, code: Optional[str] = None):
        super().__init__(f'{status}: {message}')
        self.status, self.message, self.type, self.code = status, message, type, code


def _drop_none(d: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


class APIClient:
    """Client of the OpenAI-compatible endpoints and of the native ``/generate``.

    base_url: e.g. ``http://127.0.0.1:23333`` (a trailing ``/v1`` is ignored).
    api_key: sent as ``Authorization: Bearer KEY``.
    timeout: seconds per read (a stream may take longer in total).
    """

    def __init__(self, base_url: str = 'http://127.0.0.1:23333', api_key: Optional[str] = None,
                 timeout: Optional[float] = 600.0):
        try:
            import httpx
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("APIClient needs httpx: pip install httpx (or 'lmdeploy[serve]')") from e
        base_url = base_url.rstrip('/')
        if base_url.endswith('/v1'):
            base_url = base_url[:-3]
        self.base_url = base_url
        self.api_key = api_key
        headers = {'Content-Type': 'application/json'}
        if api_key:
            headers['Authorization'] = f'Bearer {api_key}'
        self._client = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)
        self._session_tokens: Dict[int, str] = {}  # session_id -> the token the server gave for it

    # --------------------------------------------------------------- plumbing
    def close(self):
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def _raise_for(resp, body: Optional[bytes] = None):
        if resp.status_code < 400:
            return
        raw = body if body is not None else resp.content
        try:
            err = json.loads(raw)['error']
            raise APIClientError(resp.status_code, err.get('message', ''), err.get('type'), err.get('code'))
        except (ValueError, KeyError, TypeError):
            raise APIClientError(resp.status_code, raw.decode('utf-8', 'replace')) from None

    def _get(self, path: str) -> Dict[str, Any]:
        resp = self._client.get(path)
        self._raise_for(resp)
        return resp.json()

    def _post(self, path: str, payload: Dict[str, Any]) -> Dict[str, Any]:
        resp = self._client.post(path, json=payload)
        self._raise_for(resp)
        return resp.json()

    def _stream(self, path: str, payload: Dict[str, Any], sse: bool) -> Iterator[Dict[str, Any]]:
        with self._client.stream('POST', path, json=payload) as resp:
            if resp.status_code >= 400:
                self._raise_for(resp, resp.read())
            for line in resp.iter_lines():
                if sse:
                    if not line.startswith('data:'):
                        continue
                    line = line[5:].strip()
                    if line == '[DONE]':
                        return
                line = line.strip()
                if not line:
                    continue
                item = json.loads(line)
                if isinstance(item, dict) and 'error' in item and isinstance(item['error'], dict):
                    err = item['error']
                    raise APIClientError(500, err.get('message', ''), err.get('type'), err.get('code'))
                yield item

    # ------------------------------------------------------------------ API
    def health(self) -> bool:
        """Whether the server is up and ready (``GET /health`` answers 200)."""
        import httpx
        try:
            return self._client.get('/health').status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def available_models(self) -> List[str]:
        """Ids of the served models (``GET /v1/models``)."""
        return [m['id'] for m in self._get('/v1/models')['data']]

    def metrics(self) -> str:
        """The Prometheus text of ``GET /metrics``."""
        resp = self._client.get('/metrics')
        self._raise_for(resp)
        return resp.text

    def chat_completions_v1(self, model: str, messages: Union[str, List[Dict[str, Any]]], temperature: float = 0.7,
                            top_p: float = 1.0, n: int = 1, max_tokens: Optional[int] = None,
                            stop: Union[str, List[str], None] = None, stream: bool = False,
                            presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                            user: Optional[str] = None, repetition_penalty: float = 1.0, session_id: int = -1,
                            ignore_eos: bool = False, skip_special_tokens: bool = True, top_k: int = 40,
                            **kwargs) -> Iterator[Dict[str, Any]]:
        """``POST /v1/chat/completions``: yields the response, or its chunks when streaming.
        Any other field (seed, logprobs, top_logprobs, min_p, stream_options, ...) goes in ``kwargs``."""
        payload = _drop_none(dict(model=model, messages=messages, temperature=temperature, top_p=top_p, n=n,
                                  max_tokens=max_tokens, stop=stop, stream=stream, presence_penalty=presence_penalty,
                                  frequency_penalty=frequency_penalty, user=user,
                                  repetition_penalty=repetition_penalty, session_id=session_id,
                                  ignore_eos=ignore_eos, skip_special_tokens=skip_special_tokens, top_k=top_k,
                                  **kwargs))
        if stream:
            yield from self._stream('/v1/chat/completions', payload, sse=True)
        else:
            yield self._post('/v1/chat/completions', payload)

    def completions_v1(self, model: str, prompt: Union[str, List[Any]], suffix: Optional[str] = None,
                       temperature: float = 0.7, n: int = 1, max_tokens: Optional[int] = 16, stream: bool = False,
                       top_p: float = 1.0, logprobs: Optional[int] = None, stop: Union[str, List[str], None] = None,
                       user: Optional[str] = None, repetition_penalty: float = 1.0, session_id: int = -1,
                       ignore_eos: bool = False, skip_special_tokens: bool = True, top_k: int = 40,
                       **kwargs) -> Iterator[Dict[str, Any]]:
        """``POST /v1/completions``: yields the response, or its chunks when streaming."""
        payload = _drop_none(dict(model=model, prompt=prompt, suffix=suffix, temperature=temperature, n=n,
                                  max_tokens=max_tokens, stream=stream, top_p=top_p, logprobs=logprobs, stop=stop,
                                  user=user, repetition_penalty=repetition_penalty, session_id=session_id,
                                  ignore_eos=ignore_eos, skip_special_tokens=skip_special_tokens, top_k=top_k,
                                  **kwargs))
        if stream:
            yield from self._stream('/v1/completions', payload, sse=True)
        else:
            yield self._post('/v1/completions', payload)

    def generate(self, prompt: Union[str, List[Dict[str, Any]]] = '', session_id: int = -1,
                 interactive_mode: bool = False, stream: bool = False, stop: Union[str, List[str], None] = None,
                 request_output_len: Optional[int] = None, top_p: float = 0.8, top_k: int = 40,
                 temperature: float = 0.8, repetition_penalty: float = 1.0, ignore_eos: bool = False,
                 skip_special_tokens: bool = True, **kwargs) -> Iterator[Dict[str, Any]]:
        """``POST /generate`` (LMDeploy's native API): yields the response, or its
        increments when streaming. Each has ``text``, ``tokens``,
        ``input_tokens``, ``history_tokens``, ``finish_reason``, ``session_id``.

        interactive_mode: keep the session's KV cache after this turn; the next
        call with the same session_id sends only the new turn. ``session_id=-1``
        lets the server pick one (returned in ``session_id``). The session's
        ``session_token`` is kept and sent back for the same session_id.
        """
        payload = _drop_none(dict(prompt=prompt, session_id=session_id, interactive_mode=interactive_mode,
                                  stream=stream, stop=stop, request_output_len=request_output_len, top_p=top_p,
                                  top_k=top_k, temperature=temperature, repetition_penalty=repetition_penalty,
                                  ignore_eos=ignore_eos, skip_special_tokens=skip_special_tokens,
                                  session_token=kwargs.pop('session_token', None) or
                                  self._session_tokens.get(session_id), **kwargs))
        try:
            items = self._stream('/generate', payload, sse=False) if stream else iter([self._post('/generate',
                                                                                               payload)])
            for item in items:
                self._remember_token(item, interactive_mode)
                yield item
        except APIClientError as e:
            if e.code == 'session_not_found':  # it has ended: the next call with this id starts a new one
                self._session_tokens.pop(session_id, None)
            raise

    def _remember_token(self, item: Dict[str, Any], interactive_mode: bool):
        """Keep an interactive session's token (from its first answer on, so a stream can be cancelled);
        forget it once the session's last turn has finished."""
        sid, token = item.get('session_id'), item.get('session_token')
        if sid is None or token is None:
            return
        if interactive_mode or item.get('finish_reason') is None:
            self._session_tokens[sid] = token
        else:
            self._session_tokens.pop(sid, None)

    # LMDeploy's name for the same endpoint
    chat_interactive_v1 = generate

    def generate_text(self, prompt: Union[str, List[Dict[str, Any]]], **kwargs) -> str:
        """The whole text of one ``/generate`` call (streamed or not)."""
        return ''.join(item['text'] for item in self.generate(prompt, **kwargs))

    def end_session(self, session_id: int) -> Dict[str, Any]:
        """Forget an interactive session and free its KV cache."""
        token = self._session_tokens.pop(session_id, None)
        return self._post('/generate', _drop_none({'session_id': session_id, 'session_token': token,
                                                   'end_session': True}))

    def cancel(self, session_id: int) -> Dict[str, Any]:
        """Stop the session's running request (it finishes with 'abort')."""
        token = self._session_tokens.get(session_id)
        return self._post('/generate', _drop_none({'session_id': session_id, 'session_token': token,
                                                   'cancel': True}))
