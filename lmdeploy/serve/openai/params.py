"""Request fields turned into engine inputs (prompt ids, GenerationConfig) and outputs into response fields."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from lmdeploy.frontend.gateway import check_text
from lmdeploy.messages import GenerationConfig

from . import protocol as P
from .errors import APIError
from .protocol import MAX_PROMPTS, MAX_STOP_WORD_LEN, MAX_STOP_WORDS  # noqa: F401 (the schema's limits)

if TYPE_CHECKING:
    from .state import ServerState

COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default)


# ---------------------------------------------------------------- validation
def check_model(state: ServerState, model: str):
    if model != state.model_name:
        raise APIError(404, f'the model {model!r} does not exist; this server serves {state.model_name!r} '
                       '(see GET /v1/models)', 'model_not_found', 'model')


def _stop_words(stop) -> Optional[List[str]]:
    """The request's stop strings (the schema bounds them too: this says why in words)."""
    if stop is None:
        return None
    words = [stop] if isinstance(stop, str) else list(stop)
    if len(words) > MAX_STOP_WORDS:
        raise APIError(400, f'stop: at most {MAX_STOP_WORDS} strings, got {len(words)}', 'invalid_value', 'stop')
    for w in words:
        if not w:
            raise APIError(400, 'stop: the strings must not be empty', 'invalid_value', 'stop')
        if len(w) > MAX_STOP_WORD_LEN:
            raise APIError(400, f'stop: each string has at most {MAX_STOP_WORD_LEN} characters', 'invalid_value',
                           'stop')
        try:
            check_text(w, f'stop string {w[:40]!r}')
        except ValueError as e:
            raise APIError(400, f'stop: {e}', 'invalid_value', 'stop') from None
    return words or None


def check_unsupported(req):
    if (req.n or 1) > 1 and req.session_id not in (None, -1):
        raise APIError(400, 'session_id needs n=1 (a session holds one conversation)', 'invalid_value', 'n')


def _logit_bias(state: ServerState, bias: Optional[Dict[str, float]]) -> Optional[Dict[int, float]]:
    """OpenAI's logit_bias (token id as a string -> bias in [-100, 100]) with the ids as integers; an id that
    is not a token of this model is a 400."""
    if not bias:
        return None
    vocab = state.gateway.engine.model_config.vocab_size
    out = {}
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab:
            raise APIError(400, f'logit_bias: {key!r} is not a token id of this model (ids are 0 to {vocab - 1})',
                           'invalid_value', 'logit_bias')
        out[token] = out.get(token, 0.0) + value
    return out


def gen_config(state: ServerState, req, max_new_tokens: int, logprobs: Optional[int]) -> GenerationConfig:
    """The request's settings; where it is silent about sampling, the model's own defaults
    (:mod:`lmdeploy.frontend.sampling_defaults`: greedy when its generation_config.json gives none)."""
    defaults = state.gateway.sampling_defaults

    def given(name: str):
        value = getattr(req, name, None)
        return getattr(defaults, name) if value is None else value

    seed = req.seed
    vocab = state.gateway.engine.model_config.vocab_size
    try:
        return GenerationConfig(
            n=1, max_new_tokens=max_new_tokens, do_sample=True,
            temperature=given('temperature'),  # below GREEDY_TEMPERATURE (0 included): greedy
            top_p=given('top_p'),
            top_k=min(given('top_k'), vocab),
            min_p=given('min_p'),
            repetition_penalty=given('repetition_penalty'),
            # (OpenAI's fields: /generate has none of them)
            frequency_penalty=getattr(req, 'frequency_penalty', None) or 0.0,
            presence_penalty=getattr(req, 'presence_penalty', None) or 0.0,
            logit_bias=_logit_bias(state, getattr(req, 'logit_bias', None)),
            ignore_eos=bool(req.ignore_eos),
            # the sampler hashes 32 bits of the seed: any int maps onto them
            random_seed=None if seed is None else seed & 0xFFFFFFFF,
            stop_words=_stop_words(req.stop),
            min_new_tokens=req.min_new_tokens,
            skip_special_tokens=req.skip_special_tokens is not False,
            spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
            logprobs=logprobs,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            response_format=_response_format(getattr(req, 'response_format', None)))
    except ValueError as e:
        raise APIError(400, str(e).replace('GenerationConfig.', ''), 'invalid_value') from None


def _response_format(fmt) -> Optional[Dict[str, Any]]:
    """The request's response_format as a dict (None for plain text); a malformed one is a 400. Whether its
    grammar compiles is :func:`compile_grammar`'s to say."""
    if fmt is None:
        return None
    from lmdeploy.engine.grammar import spec_from_response_format
    fmt = fmt.model_dump(exclude_none=True, by_alias=True)
    try:
        spec = spec_from_response_format(fmt)
    except ValueError as e:
        raise APIError(400, str(e), 'invalid_value', 'response_format') from None
    return fmt if spec is not None else None


async def require_grammars(state: ServerState, feature: str, param: str):
    """The grammar compiler; without xgrammar, a 400 that says which part of the request needs it."""
    try:
        return await asyncio.to_thread(state.gateway.grammars)
    except ValueError:  # xgrammar is missing
        raise APIError(400, f"{feature} needs the xgrammar package, which this server lacks (pip install "
                       "'lmdeploy[structured]')", 'unsupported_parameter', param) from None


async def compile_grammar(state: ServerState, spec, param: str = 'response_format', what: str = ''):
    """Compile a grammar spec on a worker thread (a large schema takes milliseconds to seconds, which the
    event loop, streaming everyone's tokens, must not wait for); one that cannot be used is a 400 naming the
    reason. The compiled grammar stays in xgrammar's cache for the engine's turn."""
    if spec is None:
        return
    grammars = await require_grammars(state, 'response_format (structured output)', param)
    try:
        await asyncio.to_thread(grammars.compile, spec)
    except ValueError as e:
        message = str(e)
        if what:
            message = f'{what}: {message.split("cannot be used: ", 1)[-1]}'
        raise APIError(400, message, 'invalid_value', param) from None


def max_new_tokens(state: ServerState, num_prompt: int, max_tokens: Optional[int], history: int = 0,
                    check: bool = True) -> int:
    session_len = state.gateway.session_len
    if num_prompt == 0:
        raise APIError(400, 'the prompt is empty', 'invalid_value', 'prompt')
    total = num_prompt + history
    if check and total >= session_len:
        raise APIError(400, f"This model's maximum context length is {session_len} tokens. However, the prompt "
                       f'has {total} tokens, leaving no room for the completion.', 'context_length_exceeded')
    if max_tokens is None:
        return max(1, session_len - total)
    if check and total + max_tokens > session_len:
        raise APIError(400, f"This model's maximum context length is {session_len} tokens. However, you requested "
                       f'{total + max_tokens} tokens ({total} in the prompt, {max_tokens} for the completion). '
                       'Please reduce the length of the prompt or of the completion.', 'context_length_exceeded',
                       'max_tokens')
    return max_tokens


def check_ids(state: ServerState, ids: List[int], param: str) -> List[int]:
    vocab = state.gateway.engine.model_config.vocab_size
    if any(i < 0 or i >= vocab for i in ids):
        raise APIError(400, f'{param}: token ids must be in [0, {vocab})', 'invalid_value', param)
    return list(ids)


def encode(state: ServerState, prompt, do_preprocess: bool = True, sequence_start: bool = True, tools=None,
            tool_format=None) -> List[int]:
    try:
        return state.gateway.encode_prompt(prompt, do_preprocess=do_preprocess, sequence_start=sequence_start,
                                           tools=tools, tool_format=tool_format)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), 'invalid_value', 'messages' if isinstance(prompt, list) else 'prompt') from None
    except Exception as e:  # a chat template that trips on the input is still the input's fault
        raise APIError(400, f'cannot render the prompt: {type(e).__name__}: {e}', 'invalid_value') from None


def prompt_messages(messages) -> Union[str, List[Dict[str, Any]]]:
    """Request messages as the chat template takes them: role and content, an assistant's ``tool_calls``
    and a tool result's ``tool_call_id`` / ``name``."""
    if isinstance(messages, str):
        return messages
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        role = 'system' if d.get('role') == 'developer' else d['role']
        item = {'role': role, 'content': d.get('content')}
        if role == 'assistant' and d.get('tool_calls'):
            item['tool_calls'] = d['tool_calls']
        if role == 'tool':
            item.update({k: d[k] for k in ('tool_call_id', 'name') if k in d})
        out.append(item)
    return out


# ------------------------------------------------------------------- logprobs
class TokenText:

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: Dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self.cache) < 65536:
                self.cache[token_id] = s
        return s


def chat_logprobs(tt: TokenText, token_ids: List[int], logprobs, top_n: int) -> P.ChatChoiceLogprobs:
    content = []
    for tid, lp in zip(token_ids, logprobs or []):
        tok = tt(tid)
        tops = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(P.ChatLogprob(token=tok, logprob=finite(lp.get(tid, 0.0)), bytes=list(tok.encode()),
                                     top_logprobs=[P.TopLogprob(token=tt(i), logprob=finite(v),
                                                                bytes=list(tt(i).encode())) for i, v in tops]))
    return P.ChatChoiceLogprobs(content=content)


def completion_logprobs(tt: TokenText, token_ids: List[int], logprobs, top_n: int,
                         offset: int = 0) -> P.CompletionLogprobs:
    out = P.CompletionLogprobs()
    for tid, lp in zip(token_ids, logprobs or []):
        tok = tt(tid)
        out.tokens.append(tok)
        if lp is None:  # an echoed prompt's first token: nothing precedes it (null, as OpenAI)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(finite(lp.get(tid, 0.0)))
            out.top_logprobs.append({tt(i): finite(v)
                                     for i, v in sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def finite(x: float) -> float:
    return max(float(x), -1e30)  # -inf is not JSON


def usage_info(prompt: int, completion: int) -> P.UsageInfo:
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def choice_configs(gen: GenerationConfig, n: int) -> List[GenerationConfig]:
    """One GenerationConfig per choice: choice i draws with seed + i (reproducible when seeded)."""
    if n == 1 or gen.random_seed is None:
        return [gen] * n
    return [dataclasses.replace(gen, random_seed=(gen.random_seed + i) & 0xFFFFFFFF) for i in range(n)]


