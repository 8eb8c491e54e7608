"""OpenAI's deprecated function calling, mapped onto tools: the request's ``functions`` are tools of type
function and ``function_call`` ("none", "auto", ``{"name": ...}``) their ``tool_choice``; an assistant
turn's ``function_call`` is one more of its ``tool_calls`` and a ``role: "function"`` turn is a ``tool``
turn answering the last call of that name. The chat handler answers such a request in the legacy shape
(``message.function_call``, ``finish_reason: "function_call"``; streamed, ``delta.function_call``): one
call, as the legacy API has no more (calls after the first are dropped)."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple, Union

from . import protocol as P
from .errors import APIError


def is_legacy(req: P.ChatCompletionRequest) -> bool:
    """Whether the request uses functions / function_call; refused (400) beside tools / tool_choice."""
    legacy = [name for name in ('functions', 'function_call') if getattr(req, name) is not None]
    modern = [name for name in ('tools', 'tool_choice') if getattr(req, name) is not None]
    if legacy and modern:
        raise APIError(400, f'{" and ".join(legacy)} (deprecated) cannot be combined with {" and ".join(modern)}: '
                       'send functions and function_call, or tools and tool_choice', 'invalid_value', legacy[0])
    return bool(legacy)


def as_tools(req: P.ChatCompletionRequest) -> Tuple[Optional[List[Dict[str, Any]]], Any, bool]:
    """The request's functions and function_call as (tools, tool_choice, parallel_tool_calls)."""
    tools = None if req.functions is None else [{'type': 'function', 'function': f.model_dump(exclude_none=True)}
                                                for f in req.functions]
    choice = req.function_call
    if isinstance(choice, P.NamedFunction):
        choice = {'type': 'function', 'function': {'name': choice.name}}
    return tools, choice, False


_WORDS = [(re.compile(r'\btools\[(\d+)\]\.function\.'), r'functions[\1].'), (re.compile(r'\btools\b'), 'functions'),
          (re.compile(r'\btool_choice\b'), 'function_call')]
PARAMS = {'tools': 'functions', 'tool_choice': 'function_call'}


def legacy_words(message: str) -> str:
    """A message about tools / tool_choice, in the words of functions / function_call."""
    for pattern, words in _WORDS:
        message = pattern.sub(words, message)
    return message


def messages(messages: Union[str, List[P.ChatMessage]]) -> Union[str, List[P.ChatMessage]]:
    """Messages with the deprecated turns in the tools' shape: an assistant's ``function_call`` appended to
    its ``tool_calls`` (an id made from its place), a ``function`` turn a ``tool`` turn with that call's id."""
    if isinstance(messages, str) or not any(m.role == 'function' or m.function_call is not None for m in messages):
        return messages
    out, last_call = [], {}  # function name -> the id of its latest call
    for i, m in enumerate(messages):
        if m.role == 'assistant' and m.function_call is not None:
            call_id = f'call_{i}'
            last_call[m.function_call.name] = call_id
            call = P.MessageToolCall.model_construct(id=call_id, type='function', function=m.function_call)
            m = m.model_copy(update={'tool_calls': list(m.tool_calls or []) + [call], 'function_call': None})
        elif m.role == 'function':
            update: Dict[str, Any] = {'role': 'tool'}
            if m.tool_call_id is None and m.name in last_call:
                update['tool_call_id'] = last_call[m.name]
            m = m.model_copy(update=update)
        out.append(m)
    return out
