"""Request and response bodies of the API server (pydantic v2).

The OpenAI fields keep OpenAI's names and meaning; LMDeploy's extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``skip_special_tokens``, ``session_id``, ...) sit beside them, as in LMDeploy's
own server. Unknown fields are ignored.

Requests are checked here exactly as the OpenAPI schema describes them:
strict JSON types (``"8"`` and ``true`` are not integers, ``false`` is not a
number; code ``invalid_body``), value ranges and lengths (code
``invalid_value``), and the rules between fields (``RULES``: e.g.
``top_logprobs`` needs ``logprobs: true``), which the handlers check again
with their own words. A field that takes several JSON types (``messages``: a
string or an array) is read by the type it has, so an error names that one
reading. Both kinds are answered with a 400, as OpenAI answers them (see
``errors._validation_code``).
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag
from typing_extensions import Annotated

from lmdeploy.frontend.tool_calls.request import MAX_TOOLS, NAME_PATTERN

from .schema import SERVED_MODEL, TOKEN_ID, TOKEN_KEY

MAX_STOP_WORDS = 16
MAX_STOP_WORD_LEN = 256
MAX_PROMPTS = 256  # prompts in one /v1/completions request


def _hint(**by_type: Dict[str, Any]):
    """Schema-only limits, by JSON type (``string={'minLength': 1}``): documented in
    the OpenAPI schema, checked by the handlers with their own clear messages."""

    def apply(schema: Dict[str, Any]):
        for arm in schema.get('anyOf') or [schema]:
            arm.update(by_type.get(arm.get('type'), {}))

    return apply


class APIModel(BaseModel):
    # NaN / inf are not valid numbers for any field (Python's json accepts them)
    model_config = ConfigDict(allow_inf_nan=False, protected_namespaces=())


class _Request(APIModel):
    """A request body (or part of one): JSON types as the schema says them, no coercion."""
    model_config = ConfigDict(allow_inf_nan=False, protected_namespaces=(), strict=True)


def _whole(value: Any) -> Any:
    """A JSON integer as Python reads it: ``3`` or ``3.0`` (JSON Schema's integers include the latter; a
    string or a boolean is not one)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(**limits):
    """An integer field: strict, but 3.0 is 3 (as the schema's "integer" has it); ``limits`` are Field's
    (ge=, le=, ...), put before the conversion so that the schema shows them."""
    return Annotated[int, Field(**limits), BeforeValidator(_whole)]


def _json_type(value: Any) -> Optional[str]:
    """The JSON type of a parsed value; an array by its first item (``prompt``'s arrays differ there)."""
    if isinstance(value, list):
        first = _whole(value[0]) if value else ''
        return {str: 'array', int: 'array_of_ids', list: 'array_of_arrays'}.get(type(first), 'array')
    if isinstance(value, BaseModel):  # (a request built in Python)
        return 'object'
    return {str: 'string', dict: 'object'}.get(type(value))


# the tags of the unions below: an error's location names the field, not them (errors._describe drops them)
UNION_TAGS = frozenset({'string', 'object', 'array', 'array_of_ids', 'array_of_arrays'})


def _by_json_type(what: str, **arms):
    """A union read by the value's JSON type: ``string=`` / ``object=`` / ``array=`` (an array of strings or
    objects), ``array_of_ids=`` / ``array_of_arrays=`` (arrays whose first item is an integer / an array).
    A value of another type is one error, "Input should be {what}"; a value of one of these types is
    checked against that arm alone, so its errors are that arm's, not every arm's."""
    def pick(value: Any) -> Optional[str]:
        tag = _json_type(value)
        if tag not in arms and tag in ('array_of_ids', 'array_of_arrays'):
            tag = 'array'
        return tag if tag in arms else None

    return Annotated[Union[tuple(Annotated[t, Tag(tag)] for tag, t in arms.items())],
                     Discriminator(pick, custom_error_type='invalid_type',
                                   custom_error_message=f'Input should be {what}')]


_StopWord = Annotated[str, Field(min_length=1, max_length=MAX_STOP_WORD_LEN)]
Stop = _by_json_type(f'a string or an array of at most {MAX_STOP_WORDS} strings', string=_StopWord,
                     array=Annotated[List[_StopWord], Field(max_length=MAX_STOP_WORDS)])
_STOP_DOC = (f'a string or at most {MAX_STOP_WORDS} strings, each 1 to {MAX_STOP_WORD_LEN} characters; the text '
             'ends before the first one generated')
# below the vocabulary size too, which the served schema says (schema.py)
_TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID: True}), BeforeValidator(_whole)]


# logit_bias keys: token ids written as decimal strings (OpenAI's form); the served schema bounds them by the
# vocabulary (schema.py)
_TokenKey = Annotated[str, Field(pattern=r'^(0|[1-9][0-9]{0,9})$')]
MAX_LOGIT_BIAS = 1024  # biased tokens per request


def _keys_are_token_ids(schema: Dict[str, Any]):
    """A ``{token id: number}`` object as JSON Schema says it: every key is a token id, no other key."""
    for arm in schema.get('anyOf') or [schema]:
        if arm.get('type') == 'object':
            (pattern, values), = arm.pop('patternProperties').items()
            arm['propertyNames'] = {'pattern': pattern, TOKEN_KEY: True}
            arm['additionalProperties'] = values


def _rule(if_: Dict[str, Any], then: Dict[str, Any]) -> Dict[str, Any]:
    return {'if': if_, 'then': then}


def _given(name: str, schema: Dict[str, Any]) -> Dict[str, Any]:
    """"``name`` is present and matches ``schema``" (an if-clause)."""
    return {'required': [name], 'properties': {name: schema}}


_NO_SESSION = {'anyOf': [{'type': 'null'}, {'const': -1}]}
_FORCED_CHOICE = {'anyOf': [{'const': 'required'}, {'type': 'object'}]}
_ABSENT = {'type': 'null'}
# the rules between fields (JSON Schema if / then), by request; the handlers say the same in words
RULES = {
    'n': _rule(_given('n', {'type': 'integer', 'minimum': 2}), {'properties': {'session_id': _NO_SESSION}}),
    'top_logprobs': _rule(_given('top_logprobs', {'type': 'integer'}),
                          _given('logprobs', {'const': True})),
    # (a forced call is under the tools' grammar: a response_format governs only replies that are text)
    'tool_choice': _rule(_given('tool_choice', _FORCED_CHOICE), {
        'required': ['tools'], 'properties': {'tools': {'type': 'array', 'minItems': 1}}}),
    # the deprecated functions / function_call: not beside tools / tool_choice; a named call needs functions
    'functions': {'allOf': [
        _rule(_given('functions', {'type': 'array'}), {'properties': {'tools': _ABSENT, 'tool_choice': _ABSENT}}),
        _rule(_given('function_call', {'type': ['string', 'object']}),
              {'properties': {'tools': _ABSENT, 'tool_choice': _ABSENT}}),
        _rule(_given('function_call', {'type': 'object'}), {
            'required': ['functions'], 'properties': {'functions': {'type': 'array', 'minItems': 1}}})]},
    'session_prompt': _rule(_given('session_id', {'type': 'integer', 'not': {'const': -1}}), {'properties': {
        'prompt': {'anyOf': [{'type': 'string'}, {'type': 'array', 'maxItems': 1},
                             {'type': 'array', 'items': {'type': 'integer'}}]}}}),
    # /v1/completions: prompts x n <= MAX_PROMPTS (an array of token ids is one prompt)
    'choices': {'allOf': [_rule(_given('n', {'type': 'integer', 'minimum': n}), {'properties': {'prompt': {'anyOf': [
        {'type': 'string'}, {'type': 'array', 'items': {'type': 'integer'}},
        {'type': 'array', 'maxItems': MAX_PROMPTS // n}]}}}) for n in range(2, 17)]},
    'output_len': _rule(_given('max_tokens', {'type': 'integer'}),
                        {'properties': {'request_output_len': {'type': 'null'}}}),
    'raw_prompt': _rule(_given('do_preprocess', {'const': False}), {'anyOf': [
        _given('input_ids', {'type': 'array'}), _given('prompt', {'minLength': 1, 'minItems': 1}),
        _given('cancel', {'const': True}), _given('end_session', {'const': True})]}),
}


def _rules(*names: str) -> ConfigDict:
    return ConfigDict(allow_inf_nan=False, protected_namespaces=(), strict=True,
                      json_schema_extra={'allOf': [RULES[n] for n in names]})


# ---------------------------------------------------------------------- errors
class ErrorInfo(APIModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(APIModel):
    """Every error: ``{"error": {"message", "type", "param", "code"}}``."""
    error: ErrorInfo


# ---------------------------------------------------------------------- models
class ModelCard(APIModel):
    id: str
    object: Literal['model'] = 'model'
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = 'lmdeploy'
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(APIModel):
    object: Literal['list'] = 'list'
    data: List[ModelCard] = Field(default_factory=list)


# ------------------------------------------------------------------- requests
class StreamOptions(_Request):
    include_usage: Optional[bool] = False


class ContentPart(_Request):
    """A part of a message's content: only text parts, ``{"type": "text", "text": ...}``, are supported."""
    type: Literal['text'] = Field(description='only text parts are supported')
    text: str


class CalledFunction(_Request):
    name: str
    arguments: Union[str, Dict[str, Any], None] = Field(None, description='the JSON text of an object (or the '
                                                        'object)')


class MessageToolCall(_Request):
    """A call an earlier assistant turn made (OpenAI's shape)."""
    id: Optional[str] = None
    type: Optional[Literal['function']] = 'function'
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal['system', 'user', 'assistant', 'tool', 'function', 'developer'] = Field(
        description="'developer' is read as 'system'; 'function' (deprecated) is a 'tool' turn: the result of "
        "the function `name`")
    content: Optional[_by_json_type('a string or an array of text parts', string=str,
                                    array=List[ContentPart])] = None
    name: Optional[str] = Field(None, description="a 'function' turn's function")
    tool_calls: Optional[List[MessageToolCall]] = Field(None, description="an assistant turn's calls")
    tool_call_id: Optional[str] = Field(None, description='the call a tool turn answers')
    function_call: Optional[CalledFunction] = Field(None, description="deprecated: an assistant turn's call "
                                                    '(read as one more of its tool_calls)')


class FunctionDefinition(_Request):
    name: str = Field(pattern=NAME_PATTERN, description='1 to 64 letters, digits, underscores, dots, dashes; '
                      'unique among the tools')
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = Field(None, description='a JSON schema of the arguments object')
    strict: Optional[bool] = None


class Tool(_Request):
    type: Literal['function'] = 'function'
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str = Field(description='one of the tools')


class NamedToolChoice(_Request):
    type: Literal['function'] = 'function'
    function: NamedFunction


class JsonSchemaSpec(_Request):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Dict[str, Any] = Field(alias='schema', description='the JSON schema the reply follows')
    strict: Optional[bool] = None


class TextFormat(_Request):
    type: Literal['text']


class JsonObjectFormat(_Request):
    type: Literal['json_object']


class JsonSchemaFormat(_Request):
    type: Literal['json_schema']
    json_schema: JsonSchemaSpec


class RegexFormat(_Request):
    type: Literal['regex']
    regex: str = Field(min_length=1, json_schema_extra={'format': 'regex'})


class RegexSchemaFormat(_Request):
    """LMDeploy's spelling of ``regex``."""
    type: Literal['regex_schema']
    regex_schema: str = Field(min_length=1, json_schema_extra={'format': 'regex'})


class StructuralTagFormat(_Request):
    """xgrammar's structural tag (what forces tool calls)."""
    type: Literal['structural_tag']
    format: Dict[str, Any]


_FORMATS = {'text': TextFormat, 'json_object': JsonObjectFormat, 'json_schema': JsonSchemaFormat,
            'regex': RegexFormat, 'regex_schema': RegexSchemaFormat, 'structural_tag': StructuralTagFormat}


def _format_tag(value: Any) -> Optional[str]:
    kind = value.get('type') if isinstance(value, dict) else getattr(value, 'type', None)
    return f'type={kind}' if kind in _FORMATS else None


# Structured output: ``text``; ``json_object``; ``json_schema`` with ``json_schema: {name, schema}``; ``regex``
# with ``regex`` (or LMDeploy's ``regex_schema``); xgrammar's ``structural_tag`` with ``format``. Needs the
# xgrammar package. Read by its type (an error names that format's field, not every format's).
ResponseFormat = Annotated[Union[tuple(Annotated[m, Tag(f'type={k}')] for k, m in _FORMATS.items())],
                           Discriminator(_format_tag, custom_error_type='invalid_format_type', custom_error_message=(
                               'Input should be an object whose "type" is one of ' + ', '.join(map(repr, _FORMATS))))]
UNION_TAGS = UNION_TAGS | {f'type={k}' for k in _FORMATS}


class _SamplingFields(_Request):
    """Fields /v1/chat/completions and /v1/completions share. Sampling fields left out (or null) take the
    model's defaults (its generation_config.json; greedy decoding where it gives none)."""
    model: str = Field(description='the served model name (see GET /v1/models)',
                       json_schema_extra={SERVED_MODEL: True})
    temperature: Optional[float] = Field(None, ge=0, le=2, description='below 1e-5 (0 too) decodes greedily; '
                                         "default: the model's (greedy if it gives none)")
    top_p: Optional[float] = Field(None, gt=0, le=1, description="default: the model's (else 1)")
    n: Optional[_int(ge=1, le=16)] = Field(1, description='choices per prompt (they share its prefill when '
                             'prefix caching is on); with a seed, choice i uses seed + i; n > 1 takes no '
                             'session_id')
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Stop] = Field(None, description=_STOP_DOC)
    seed: Optional[_int()] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, description="OpenAI's: a token's score drops "
                                              'by this once it was generated (0: none)')
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, description="OpenAI's: a token's score drops "
                                               'by this times how often it was generated (0: none)')
    logit_bias: Optional[Dict[_TokenKey, Annotated[float, Field(ge=-100, le=100)]]] = Field(
        None, max_length=MAX_LOGIT_BIAS, json_schema_extra=_keys_are_token_ids, description='token id (a '
        'string) -> bias in [-100, 100], added to its score before sampling')
    user: Optional[str] = None
    # LMDeploy extensions
    top_k: Optional[_int(ge=0)] = Field(None, description="0 disables; default: the model's (else 0)")
    min_p: Optional[float] = Field(None, ge=0, le=1, description="default: the model's (else 0)")
    repetition_penalty: Optional[float] = Field(None, gt=0, le=100, description="1: none; default: the model's "
                                                '(else 1)')
    ignore_eos: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    spaces_between_special_tokens: Optional[bool] = True
    include_stop_str_in_output: Optional[bool] = False
    min_new_tokens: Optional[_int(ge=0)] = Field(None)
    session_id: Optional[_int()] = Field(None, description='a name for the request (on a server with API keys, '
                                      'cancel it with POST /generate {"session_id": ID, "cancel": true} under '
                                      'the same key); -1 or absent: none')
    response_format: Optional[ResponseFormat] = Field(None, description='structured output (JSON, a JSON '
                                                      'schema, a regex); needs the xgrammar package')


class ChatCompletionRequest(_SamplingFields):
    model_config = _rules('n', 'top_logprobs', 'tool_choice', 'functions')
    messages: _by_json_type('a string or an array of messages', string=Annotated[str, Field(min_length=1)],
                            array=Annotated[List[ChatMessage], Field(min_length=1)]) = Field(
        description='the conversation; a string is one user turn')
    max_tokens: Optional[_int(ge=1)] = Field(None, description='default: up to session_len')
    max_completion_tokens: Optional[_int(ge=1)] = Field(None, description='overrides max_tokens')
    logprobs: Optional[bool] = False
    top_logprobs: Optional[_int(ge=0, le=20)] = Field(None, description='needs logprobs: true')
    tools: Optional[List[Tool]] = Field(None, max_length=MAX_TOOLS, description='functions the model may call')
    tool_choice: Optional[_by_json_type('"none", "auto", "required" or a named function',
                                        string=Literal['none', 'auto', 'required'], object=NamedToolChoice)] = Field(
        None, description='"none", "auto" (default with tools), "required" or {"type": "function", "function": '
        '{"name": ...}}; the last two need tools and are enforced by a grammar, so the reply always parses (they '
        'need the xgrammar package; a response_format does not apply to such a reply, which is calls, not text)')
    parallel_tool_calls: Optional[bool] = Field(None, description='with "required": may the reply hold several '
                                                'calls (default true)')
    functions: Optional[List[FunctionDefinition]] = Field(
        None, max_length=MAX_TOOLS, description='deprecated form of tools (not with tools or tool_choice): '
        'functions the model may call; a call comes back as message.function_call (one call, finish_reason '
        '"function_call")')
    function_call: Optional[_by_json_type('"none", "auto" or a named function', string=Literal['none', 'auto'],
                                          object=NamedFunction)] = Field(
        None, description='deprecated form of tool_choice (not with tools or tool_choice): "none", "auto" '
        '(default with functions) or {"name": ...} (one of functions; enforced by a grammar as tool_choice\'s)')


class CompletionRequest(_SamplingFields):
    model_config = _rules('n', 'session_prompt', 'choices')
    prompt: _by_json_type(
        'a string, an array of strings, an array of token ids or an array of arrays of token ids',
        string=Annotated[str, Field(min_length=1)],
        array=Annotated[List[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)],
        array_of_ids=Annotated[List[_TokenId], Field(min_length=1)],
        array_of_arrays=Annotated[List[Annotated[List[_TokenId], Field(min_length=1)]],
                                  Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        description='a string, a list of strings, a list of token ids or a list of those (one prompt with a '
        'session_id)')
    max_tokens: Optional[_int(ge=0)] = Field(16, description='16 if absent or null, as OpenAI; 0 generates '
                                            'nothing (with echo: the prompt is only scored)')
    logprobs: Optional[_int(ge=0, le=20)] = Field(None, description='the chosen tokens\' logprobs and this many '
                                                  'most likely alternatives; with echo, the prompt\'s too')
    echo: Optional[bool] = Field(False, description='the prompt comes first in the text (and, with logprobs, its '
                                 "tokens' logprobs from the prompt's forward pass; the first token's is null)")
    suffix: Optional[str] = Field(None, description='not supported', json_schema_extra=_hint(string={'maxLength': 0}))
    best_of: Optional[_int()] = Field(None, description='only 1 is supported',
                                   json_schema_extra=_hint(integer={'minimum': 1, 'maximum': 1}))


class GenerateRequest(_Request):
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
    model_config = _rules('output_len', 'raw_prompt')
    prompt: _by_json_type('a string or an array of messages', string=str, array=List[ChatMessage]) = Field(
        '', description='a string (templated as a user turn unless do_preprocess is false) or messages; empty: '
        'ends a live session')
    input_ids: Optional[Annotated[List[_TokenId], Field(min_length=1)]] = Field(
        None, description='token ids sent as they are (no chat template; integers, not booleans or strings)')
    session_id: _int() = -1
    session_token: Optional[str] = Field(None, min_length=1, max_length=128,
                                         description='the token a response of this session gave: reaches it '
                                         'without an API key (an unknown one: 404 session_not_found)')
    interactive_mode: bool = False
    stream: bool = False
    stop: Optional[Stop] = Field(None, description=_STOP_DOC)
    request_output_len: Optional[_int(ge=1)] = Field(None, description='max new tokens; default: up to '
                                              'session_len')
    max_tokens: Optional[_int(ge=1)] = Field(None, description="request_output_len under OpenAI's name (give one "
                                      'of the two)')
    # sampling: left out (or null), the model's defaults (its generation_config.json; greedy where it gives none)
    top_p: Optional[float] = Field(None, gt=0, le=1, description="default: the model's (else 1)")
    top_k: Optional[_int(ge=0)] = Field(None, description="0 disables; default: the model's (else 0)")
    min_p: Optional[float] = Field(None, ge=0, le=1, description="default: the model's (else 0)")
    temperature: Optional[float] = Field(None, ge=0, le=2, description='below 1e-5 (0 too) decodes greedily; '
                                         "default: the model's (greedy if it gives none)")
    repetition_penalty: Optional[float] = Field(None, gt=0, le=100, description="1: none; default: the model's "
                                                '(else 1)')
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_new_tokens: Optional[_int(ge=0)] = Field(None)
    seed: Optional[_int()] = None
    logprobs: Optional[_int(ge=0, le=20)] = Field(None)
    do_preprocess: bool = Field(True, description='apply the chat template to a string prompt')
    cancel: bool = False
    end_session: bool = False


# ------------------------------------------------------------------ responses
class UsageInfo(APIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TopLogprob(APIModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class ChatLogprob(APIModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(APIModel):
    content: Optional[List[ChatLogprob]] = None


class FunctionCall(APIModel):
    name: str
    arguments: str = Field(description='the JSON text of the arguments, as the model wrote it')


class ToolCall(APIModel):
    id: str
    type: Literal['function'] = 'function'
    function: FunctionCall


class ChatResponseMessage(APIModel):
    role: str = 'assistant'
    content: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    function_call: Optional[FunctionCall] = Field(None, description='the call, where the request gave the '
                                                  'deprecated functions (then no tool_calls)')


class ChatCompletionChoice(APIModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(APIModel):
    id: str
    object: Literal['chat.completion'] = 'chat.completion'
    created: int
    model: str
    choices: List[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(APIModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(APIModel):
    """A piece of a streamed call: its first carries id, type and name; the rest, pieces of arguments."""
    index: int
    id: Optional[str] = None
    type: Optional[Literal['function']] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(APIModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[List[DeltaToolCall]] = None
    function_call: Optional[DeltaFunctionCall] = Field(None, description='with the deprecated functions: the '
                                                       "call's name first, then pieces of its arguments")


class ChatCompletionStreamChoice(APIModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionStreamResponse(APIModel):
    id: str
    object: Literal['chat.completion.chunk'] = 'chat.completion.chunk'
    created: int
    model: str
    choices: List[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class CompletionLogprobs(APIModel):
    tokens: List[str] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)
    text_offset: List[int] = Field(default_factory=list)


class CompletionChoice(APIModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(APIModel):
    id: str
    object: Literal['text_completion'] = 'text_completion'
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[UsageInfo] = None


class GenerateResponse(APIModel):
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


class HealthResponse(APIModel):
    status: str
