"""Request and response bodies of the API server (pydantic v2).

The OpenAI fields keep OpenAI's names and meaning; LMDeploy's extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``skip_special_tokens``, ``session_id``, ...) sit beside them, as in LMDeploy's
own server. Unknown fields are ignored.

Types are checked here (code ``invalid_body``); value ranges are declared
here too, so that they show in the OpenAPI schema (code ``invalid_value``);
both are answered with a 400, as OpenAI answers them (see
``errors._validation_code``).
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt


def _hint(**by_type: Dict[str, Any]):
    """Schema-only limits, by JSON type (``string={'minLength': 1}``): documented in
    the OpenAPI schema, checked by the handlers with their own clear messages."""

    def apply(schema: Dict[str, Any]):
        for arm in schema.get('anyOf') or [schema]:
            arm.update(by_type.get(arm.get('type'), {}))

    return apply


class _Model(BaseModel):
    # NaN / inf are not valid numbers for any field (Python's json accepts them)
    model_config = ConfigDict(allow_inf_nan=False, protected_namespaces=())


# ---------------------------------------------------------------------- errors
class ErrorInfo(_Model):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(_Model):
    """Every error: ``{"error": {"message", "type", "param", "code"}}``."""
    error: ErrorInfo


# ---------------------------------------------------------------------- models
class ModelCard(_Model):
    id: str
    object: Literal['model'] = 'model'
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = 'lmdeploy'
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Model):
    object: Literal['list'] = 'list'
    data: List[ModelCard] = Field(default_factory=list)


# ------------------------------------------------------------------- requests
class StreamOptions(_Model):
    include_usage: Optional[bool] = False


class ContentPart(_Model):
    """A part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""
    model_config = ConfigDict(extra='allow', allow_inf_nan=False)
    type: str
    text: Optional[str] = None


class ChatMessage(_Model):
    model_config = ConfigDict(extra='allow', allow_inf_nan=False)
    role: Literal['system', 'user', 'assistant', 'tool', 'developer'] = Field(
        description="'developer' is read as 'system'; 'tool' only where the model's template has it")
    content: Union[str, List[ContentPart], None] = None
    name: Optional[str] = None


class ResponseFormat(_Model):
    """Structured output: ``text``; ``json_object``; ``json_schema`` with ``json_schema: {name, schema}``;
    ``regex`` with ``regex`` (or LMDeploy's ``regex_schema``). Needs the xgrammar package."""
    model_config = ConfigDict(extra='allow', allow_inf_nan=False)
    type: str = Field(json_schema_extra={'enum': ['text', 'json_object', 'json_schema', 'regex', 'regex_schema']})


class _SamplingFields(_Model):
    """Fields /v1/chat/completions and /v1/completions share."""
    model: str = Field(description='the served model name (see GET /v1/models)')
    temperature: Optional[float] = Field(None, ge=0, le=2, description='0 decodes greedily; default 0.7')
    top_p: Optional[float] = Field(None, gt=0, le=1, description='default 1.0')
    n: Optional[int] = Field(1, ge=1, le=16, description='choices per prompt (they share its prefill when '
                             'prefix caching is on); with a seed, choice i uses seed + i')
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, List[str], None] = Field(None, description='at most 16 non-empty strings')
    seed: Optional[int] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, description='not supported: must be 0',
                                              json_schema_extra=_hint(number={'minimum': 0, 'maximum': 0}))
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, description='not supported: must be 0',
                                               json_schema_extra=_hint(number={'minimum': 0, 'maximum': 0}))
    logit_bias: Optional[Dict[str, float]] = Field(None, description='not supported: must be empty',
                                                   json_schema_extra=_hint(object={'maxProperties': 0}))
    user: Optional[str] = None
    # LMDeploy extensions
    top_k: Optional[int] = Field(None, ge=0, description='0 disables; default 40')
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=100)
    ignore_eos: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    spaces_between_special_tokens: Optional[bool] = True
    include_stop_str_in_output: Optional[bool] = False
    min_new_tokens: Optional[int] = Field(None, ge=0)
    session_id: Optional[int] = Field(None, description='a name for the request (on a server with API keys, '
                                      'cancel it with POST /generate {"session_id": ID, "cancel": true} under '
                                      'the same key); -1 or absent: none')
    response_format: Optional[ResponseFormat] = Field(None, description='structured output (JSON, a JSON '
                                                                         'schema, a regex)')


class ChatCompletionRequest(_SamplingFields):
    messages: Union[str, List[ChatMessage]] = Field(json_schema_extra=_hint(string={'minLength': 1},
                                                                            array={'minItems': 1}))
    max_tokens: Optional[int] = Field(None, ge=1, description='default: up to session_len')
    max_completion_tokens: Optional[int] = Field(None, ge=1, description='overrides max_tokens')
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[List[Dict[str, Any]]] = Field(None, description='functions the model may call: '
                                                  '{"type": "function", "function": {"name", "description", '
                                                  '"parameters"}}')
    tool_choice: Union[str, Dict[str, Any], None] = Field(
        None, description='"none", "auto" (default with tools), "required" or {"type": "function", "function": '
        '{"name": ...}}; the last two are enforced by a grammar, so the reply always parses')
    parallel_tool_calls: Optional[bool] = Field(None, description='with "required": may the reply hold several '
                                                'calls (default true)')


class CompletionRequest(_SamplingFields):
    prompt: Union[str, List[str], List[StrictInt], List[List[StrictInt]]] = Field(
        description='a string, a list of strings, a list of token ids or a list of those',
        json_schema_extra=_hint(string={'minLength': 1}, array={'minItems': 1}))
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: Optional[bool] = Field(False, description='not supported: must be false',
                                 json_schema_extra=_hint(boolean={'enum': [False]}))
    suffix: Optional[str] = Field(None, description='not supported', json_schema_extra=_hint(string={'maxLength': 0}))
    best_of: Optional[int] = Field(None, description='only 1 is supported',
                                   json_schema_extra=_hint(integer={'minimum': 1, 'maximum': 1}))


class GenerateRequest(_Model):
    """LMDeploy's native ``/generate``.

    session_id: -1 picks a fresh one. With ``interactive_mode`` the session
    keeps its KV cache after the turn, and the next request with the same
    session_id sends only the new turn. A request without
    ``interactive_mode`` on a live session is its last turn; an empty prompt
    (or ``end_session``) then just ends it. ``cancel`` stops the session's
    running request.

    A session belongs to the client that made it: every response carries its
    ``session_token`` (unguessable), which reaches it from any client that
    holds it; with API keys the session_id alone reaches it too, but only
    under the key that made it. Without keys a session_id alone names a new
    session. Another client's session answers as one that does not exist.
    """
    prompt: Union[str, List[ChatMessage]] = ''
    input_ids: Optional[List[StrictInt]] = Field(None, description='token ids sent as they are (no chat '
                                                 'template; integers, not booleans or strings)')
    session_id: int = -1
    session_token: Optional[str] = Field(None, min_length=1, max_length=128,
                                         description='the token a response of this session gave: reaches it '
                                         'without an API key (an unknown one: 404 session_not_found)')
    interactive_mode: bool = False
    stream: bool = False
    stop: Union[str, List[str], None] = None
    request_output_len: Optional[int] = Field(None, ge=1, description='max new tokens; default: up to '
                                              'session_len')
    max_tokens: Optional[int] = Field(None, ge=1, description="request_output_len under OpenAI's name")
    top_p: float = Field(0.8, gt=0, le=1)
    top_k: int = Field(40, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    temperature: float = Field(0.8, ge=0, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=100)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_new_tokens: Optional[int] = Field(None, ge=0)
    seed: Optional[int] = None
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    do_preprocess: bool = Field(True, description='apply the chat template to a string prompt')
    cancel: bool = False
    end_session: bool = False


# ------------------------------------------------------------------ responses
class UsageInfo(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class ChatLogprob(_Model):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Model):
    content: Optional[List[ChatLogprob]] = None


class FunctionCall(_Model):
    name: str
    arguments: str = Field(description='the JSON text of the arguments, as the model wrote it')


class ToolCall(_Model):
    id: str
    type: Literal['function'] = 'function'
    function: FunctionCall


class ChatResponseMessage(_Model):
    role: str = 'assistant'
    content: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None


class ChatCompletionChoice(_Model):
    index: int = 0
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal['chat.completion'] = 'chat.completion'
    created: int
    model: str
    choices: List[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(_Model):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Model):
    """A piece of a streamed call: its first carries id, type and name; the rest, pieces of arguments."""
    index: int
    id: Optional[str] = None
    type: Optional[Literal['function']] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(_Model):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[List[DeltaToolCall]] = None


class ChatCompletionStreamChoice(_Model):
    index: int = 0
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionStreamResponse(_Model):
    id: str
    object: Literal['chat.completion.chunk'] = 'chat.completion.chunk'
    created: int
    model: str
    choices: List[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class CompletionLogprobs(_Model):
    tokens: List[str] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)
    text_offset: List[int] = Field(default_factory=list)


class CompletionChoice(_Model):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(_Model):
    id: str
    object: Literal['text_completion'] = 'text_completion'
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[UsageInfo] = None


class GenerateResponse(_Model):
    """One /generate result, or one increment of it when streaming (newline-delimited JSON)."""
    text: str
    tokens: int = Field(description='tokens generated so far in this turn')
    input_tokens: int = Field(description='tokens in the context before generation (history included)')
    history_tokens: int = Field(0, description='tokens from earlier turns of the session')
    finish_reason: Optional[str] = None
    session_id: int
    session_token: Optional[str] = Field(None, description='send it back to continue, cancel or end the '
                                         'session (the only way to reach it on a server without API keys)')
    token_ids: List[int] = Field(default_factory=list, description='new token ids (all of them when not streaming)')
    logprobs: Optional[List[Dict[str, float]]] = None


class HealthResponse(_Model):
    status: str
