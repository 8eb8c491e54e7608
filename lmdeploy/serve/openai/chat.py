"""``POST /v1/chat/completions``: chat with n choices, logprobs, structured output and tool calls.

With ``tools`` (and ``tool_choice`` not "none") the model is told about them and each reply is split
into text and calls (:mod:`lmdeploy.frontend.tool_calls`): ``message.tool_calls`` and
``finish_reason: "tool_calls"``, or, streaming, tool-call deltas (a call's first carries id, type and
name, the rest pieces of its arguments). ``tool_choice`` "required" or a named function puts the reply
under a grammar that only lets it write calls, so it always parses. The deprecated ``functions`` /
``function_call`` are tools / tool_choice in another shape (:mod:`.functions`), answered in theirs.

``response_format`` with tools (OpenAI's reading: a call's arguments follow its function's parameters,
``response_format`` the text a reply gives the user): a forced call (tool_choice "required" or a named
function) is under the tools' grammar alone, as it has no text; with tool_choice "auto" the reply is
either calls or text in the response_format (one grammar allows both, :func:`_calls_or_format`).

:func:`chat_completions` is the handler (:func:`add_routes` registers it): it checks the request
(:func:`_generation_config` settles tools, grammar and limits), starts its jobs on the :class:`~.runner.Runner`,
then answers at once (:func:`_response`) or streams (:class:`_ChatStream`).
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Dict, List, Optional

from fastapi import Depends, FastAPI, Request

from lmdeploy.engine.grammar import GrammarSpec, spec_from_response_format
from lmdeploy.frontend.tool_calls import CallDelta, ToolCallParser, assemble
from lmdeploy.frontend.tool_calls.request import ToolError, ToolRequest, check_tools

from . import functions as legacy
from . import protocol as P
from .errors import APIError, error_body
from .guard import request_owner
from .jobs import SSE_HEADERS, Job, Result, TextChunks, accumulate, sse
from .params import (chat_logprobs, check_model, check_unsupported, choice_configs, compile_grammar, encode,
                     gen_config, max_new_tokens, prompt_messages, require_grammars, usage_info)
from .runner import Runner, request_runner
from .sessions import Lease
from .state import ServerState


def _tool_request(req: P.ChatCompletionRequest, old: bool) -> ToolRequest:
    """The request's tools (``old``: its deprecated functions), checked."""
    try:
        if old:
            return check_tools(*legacy.as_tools(req))
        tools = None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools]
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, P.NamedToolChoice) else req.tool_choice
        return check_tools(tools, choice, req.parallel_tool_calls)
    except ToolError as e:
        if old:
            raise APIError(400, legacy.legacy_words(str(e)), 'invalid_value', legacy.PARAMS[e.param]) from None
        raise APIError(400, str(e), 'invalid_value', e.param) from None


_CHOICE_PARAM = {'tools': 'tool_choice', 'functions': 'function_call'}


async def _compile_parameters(state: ServerState, tools: ToolRequest, param: str):
    """Each callable function's parameters schema, compiled: one that cannot be used is a 400 naming it."""
    for f in tools.functions():
        schema = json.dumps(f.get('parameters') or {'type': 'object'})
        await compile_grammar(state, GrammarSpec('json_schema', schema), param,
                               f'{param}: the parameters of function {f["name"]!r} are not a usable JSON schema')


async def _force_calls(state: ServerState, tools: ToolRequest, fmt, gen, param: str = 'tools'):
    """The generation config whose grammar only lets the reply be calls. A response_format is not applied:
    it governs a reply's text, and a forced reply has none (its calls' arguments follow their schemas)."""
    choice = '"required"' if tools.choice == 'required' else 'naming a function'
    what = 'function_call naming a function' if param == 'functions' else f'tool_choice {choice}'
    await require_grammars(state, f'{what} (a grammar makes the reply calls)', _CHOICE_PARAM[param])
    await _compile_parameters(state, tools, param)
    return dataclasses.replace(gen, response_format=tools.response_format(fmt))


def _format_element(spec: GrammarSpec) -> Dict[str, Any]:
    """A response_format's grammar as an element of an xgrammar structural tag."""
    if spec.kind == 'json':
        return {'type': 'json_schema', 'json_schema': {'type': 'object'}, 'max_whitespace_cnt': 1}
    if spec.kind == 'json_schema':
        return {'type': 'json_schema', 'json_schema': json.loads(spec.text), 'max_whitespace_cnt': 1}
    if spec.kind == 'regex':
        return {'type': 'regex', 'pattern': spec.text}
    return json.loads(spec.text)['format']  # a structural tag


async def _calls_or_format(state: ServerState, tools: ToolRequest, fmt, gen, param: str = 'tools'):
    """tool_choice "auto" with a response_format: the generation config whose grammar lets the reply be
    calls of the tools (as a forced reply's grammar writes them) or text in the response_format."""
    spec = spec_from_response_format(gen.response_format)
    await compile_grammar(state, spec)  # the format alone first: its own error, if it has one
    await _compile_parameters(state, tools, param)
    calls = fmt.structural_tag(tools.functions(), parallel=tools.parallel)['format']
    both = {'type': 'structural_tag', 'format': {'type': 'or', 'elements': [calls, _format_element(spec)]}}
    return dataclasses.replace(gen, response_format=both)


def _finish_reason(reason: Optional[str], calls: int, old: bool = False) -> Optional[str]:
    if calls and reason == 'stop':
        return 'function_call' if old else 'tool_calls'
    return reason


def _message(text: str, fmt, old: bool = False) -> P.ChatResponseMessage:
    """A reply as a message: text, and its calls (``old``: its first call as the legacy function_call)."""
    if fmt is None:
        return P.ChatResponseMessage(content=text)
    p = ToolCallParser(fmt)
    content, calls = assemble(p.feed(text) + p.finish())
    if not calls:
        return P.ChatResponseMessage(content=content)
    if old:
        return P.ChatResponseMessage(content=content or None, function_call=P.FunctionCall(
            name=calls[0].name, arguments=calls[0].arguments))
    return P.ChatResponseMessage(content=content or None, tool_calls=[
        P.ToolCall(id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls])


def _delta_function_call(e: CallDelta) -> P.DeltaMessage:
    """A piece of the legacy streamed call: the name first (arguments ""), then pieces of arguments."""
    if e.id is not None:
        return P.DeltaMessage(function_call=P.DeltaFunctionCall(name=e.name, arguments=e.arguments))
    return P.DeltaMessage(function_call=P.DeltaFunctionCall(arguments=e.arguments))


def _delta_tool_call(e: CallDelta) -> P.DeltaToolCall:
    if e.id is not None:
        return P.DeltaToolCall(index=e.index, id=e.id, type='function',
                               function=P.DeltaFunctionCall(name=e.name, arguments=e.arguments))
    return P.DeltaToolCall(index=e.index, function=P.DeltaFunctionCall(arguments=e.arguments))


def add_routes(app: FastAPI, auth, err):
    """Register ``POST /v1/chat/completions`` (the handler gets the app's Runner from :func:`request_runner`)."""
    app.post('/v1/chat/completions', response_model=P.ChatCompletionResponse, dependencies=auth,
             responses={**err, 200: {'content': {'text/event-stream': {}}}})(chat_completions)


async def chat_completions(req: P.ChatCompletionRequest, request: Request,
                           runner: Runner = Depends(request_runner)):
    state = runner.state
    check_model(state, req.model)
    check_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, 'top_logprobs needs logprobs=true', 'invalid_value', 'top_logprobs')
    old = legacy.is_legacy(req)
    tools = _tool_request(req, old)
    fmt = state.tool_format() if tools.active else None
    messages = prompt_messages(legacy.messages(req.messages))
    ids = encode(state, messages, tools=tools.tools if fmt else None, tool_format=fmt)
    gen = await _generation_config(state, req, tools, fmt, old, len(ids))
    rid = f'chatcmpl-{uuid.uuid4().hex}'
    runner.log_request(rid, 'chat', messages, ids, gen)
    n = req.n or 1
    lease = Lease(state, req.session_id, request_owner(state, request), exclusive=True)
    internal = [lease.internal_id] + [state.gateway.next_session_id() for _ in range(n - 1)]
    run, firsts = await runner.start(request, 'chat', lease, [  # choices 1.. take choice 0's prompt blocks
        Job(i, ids, g, sid, stream=bool(req.stream), after=0 if i else None)
        for i, (g, sid) in enumerate(zip(choice_configs(gen, n), internal))])
    created = int(time.time())
    tt = runner.token_text()
    if not req.stream:
        results = await runner.collect(request, run, firsts, lease)
        return _response(state, req, rid, created, results, fmt, old, tt)
    stream = _ChatStream(state, req, rid, created, fmt, old, n, tt)
    return runner.stream(stream.events(run, firsts), run, lease, media_type='text/event-stream',
                         headers=SSE_HEADERS)


async def _generation_config(state: ServerState, req: P.ChatCompletionRequest, tools: ToolRequest, fmt, old: bool,
                             num_prompt: int):
    """The request's generation config: its limits and sampling, then the grammar its tools and
    response_format put the reply under (each compiled now: an unusable one is a 400)."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_new = max_new_tokens(state, num_prompt, max_tokens)
    top_n = req.top_logprobs or 0
    gen = gen_config(state, req, max_new, top_n if req.logprobs else None)
    if fmt is not None:
        param = 'functions' if old else 'tools'
        if tools.forced:
            # the format, unused on this turn, is still checked: a request is valid or not whatever its tools
            await compile_grammar(state, spec_from_response_format(gen.response_format))
            gen = await _force_calls(state, tools, fmt, gen, param)
        elif gen.response_format is not None:
            gen = await _calls_or_format(state, tools, fmt, gen, param)
        if fmt.keeps_special_tokens:  # the call markers are special tokens
            gen = dataclasses.replace(gen, skip_special_tokens=False)
    await compile_grammar(state, spec_from_response_format(gen.response_format))
    return gen


def _usage(results) -> P.UsageInfo:
    """The prompt once, every choice's tokens."""
    return usage_info(max(r.input_tokens for r in results), sum(r.generated for r in results))


def _response(state: ServerState, req: P.ChatCompletionRequest, rid: str, created: int, results: List[Result], fmt,
              old: bool, tt) -> P.ChatCompletionResponse:
    """The whole reply of a request that does not stream."""
    top_n = req.top_logprobs or 0
    choices = []
    for i, r in enumerate(results):
        message = _message(r.text, fmt, old)
        calls = len(message.tool_calls or []) + (message.function_call is not None)
        choices.append(P.ChatCompletionChoice(
            index=i, message=message, finish_reason=_finish_reason(r.finish_reason, calls, old),
            logprobs=chat_logprobs(tt, r.token_ids, r.logprobs, top_n) if req.logprobs else None))
    return P.ChatCompletionResponse(id=rid, created=created, model=state.model_name, choices=choices,
                                    usage=_usage(results))


class _ChatStream:
    """A streamed reply's server-sent events: each choice's role, then its text (or, with tools, its text and
    call deltas) with logprobs, its finish reason, the usage if asked for, and ``[DONE]``."""

    def __init__(self, state: ServerState, req: P.ChatCompletionRequest, rid: str, created: int, fmt, old: bool,
                 n: int, tt):
        self.model, self.rid, self.created = state.model_name, rid, created
        self.fmt, self.old, self.n, self.tt = fmt, old, n, tt
        self.logprobs, self.top_n = req.logprobs, req.top_logprobs or 0
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.text_chunk = TextChunks(self.chunk(P.DeltaMessage(content='')), self.include_usage)
        self.parsers: List[Optional[ToolCallParser]] = [ToolCallParser(fmt) if fmt else None for _ in range(n)]

    def chunk(self, delta: P.DeltaMessage, finish_reason=None, logprobs=None, index=0):
        return P.ChatCompletionStreamResponse(
            id=self.rid, created=self.created, model=self.model,
            choices=[P.ChatCompletionStreamChoice(index=index, delta=delta, finish_reason=finish_reason,
                                                  logprobs=logprobs)])

    def tool_chunks(self, i: int, out):
        """A choice's output through its parser: text and call deltas, then the finish reason."""
        parser, include_usage = self.parsers[i], self.include_usage
        events = parser.feed(out.text)
        if out.finish_reason is not None:
            events += parser.finish()
        for e in events:
            if isinstance(e, str):
                yield self.text_chunk(e, None, i)
            elif self.old:
                if e.index == 0:  # the legacy API has one call: the rest are dropped
                    yield sse(self.chunk(_delta_function_call(e), index=i), include_usage)
            else:
                yield sse(self.chunk(P.DeltaMessage(tool_calls=[_delta_tool_call(e)]), index=i), include_usage)
        if out.finish_reason is not None:
            yield sse(self.chunk(P.DeltaMessage(), _finish_reason(out.finish_reason, parser.calls, self.old),
                                 index=i), include_usage)

    async def events(self, run, firsts):
        include_usage = self.include_usage
        for i in range(self.n):
            yield sse(self.chunk(P.DeltaMessage(role='assistant', content=''), index=i), include_usage)
        results = [Result() for _ in range(self.n)]
        async for i, out in run.iterate(firsts):
            accumulate(results[i], out)
            if out.finish_reason == 'error':
                yield sse(error_body(500, f'generation failed: {out.error}', 'internal_error'))
                break
            logprobs = (chat_logprobs(self.tt, out.token_ids, out.logprobs, self.top_n)
                        if self.logprobs and out.token_ids else None)
            if self.parsers[i] is not None:
                if logprobs is not None:  # the tokens' logprobs, ahead of what they make
                    yield sse(self.chunk(P.DeltaMessage(), None, logprobs, i), include_usage)
                for line in self.tool_chunks(i, out):
                    yield line
            elif logprobs is not None:
                yield sse(self.chunk(P.DeltaMessage(content=out.text), out.finish_reason, logprobs, i),
                          include_usage)
            elif out.text or out.finish_reason is not None:
                yield self.text_chunk(out.text, out.finish_reason, i)
        if include_usage:
            yield sse(P.ChatCompletionStreamResponse(id=self.rid, created=self.created, model=self.model,
                                                     choices=[], usage=_usage(results)))
        yield 'data: [DONE]\n\n'
