"""Structured output: grammars (any JSON, a JSON schema, a regex) that constrain sampling, via xgrammar.

A request carries a :class:`GrammarSpec` (plain data: it crosses to the engine process). Whoever holds a
tokenizer makes a :class:`Grammars` for it: the frontend to refuse a spec that does not compile (a 400
with the reason), the engine to keep one matcher per constrained sequence. Before each draw the
matchers' allowed tokens become a bitmask, filled on the host, that ``ops.apply_token_bitmask`` applies
to the logits on the device; each drawn token advances its matcher, and a matcher that has accepted a
stop token ends the request. xgrammar is an optional dependency (``pip install 'lmdeploy[structured]'``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

KINDS = ('json', 'json_schema', 'regex', 'structural_tag')


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    text: str = ''  # the schema (JSON text), the regex or the structural tag (JSON text)


def spec_from_response_format(fmt: Any) -> Optional[GrammarSpec]:
    """OpenAI's ``response_format`` (and LMDeploy's regex form) -> a spec; None for plain text.

    ``{"type": "text"}``; ``{"type": "json_object"}``; ``{"type": "json_schema", "json_schema": {"name":
    ..., "schema": {...}}}``; ``{"type": "regex", "regex": "..."}`` or LMDeploy's ``{"type":
    "regex_schema", "regex_schema": "..."}``; xgrammar's ``{"type": "structural_tag", "format": {...}}`` (what
    forces tool calls). Raises ValueError saying what is wrong."""
    if fmt is None:
        return None
    if hasattr(fmt, 'model_dump'):
        fmt = fmt.model_dump(exclude_none=True, by_alias=True)
    if not isinstance(fmt, dict) or not isinstance(fmt.get('type'), str):
        raise ValueError('response_format must be an object with a "type": "text", "json_object", '
                         '"json_schema" or "regex"')
    kind = fmt['type']
    if kind == 'text':
        return None
    if kind == 'json_object':
        return GrammarSpec('json')
    if kind == 'json_schema':
        body = fmt.get('json_schema')
        schema = body.get('schema', body.get('json_schema')) if isinstance(body, dict) else None
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f'response_format.json_schema.schema is not valid JSON: {e}') from None
        if not isinstance(schema, dict):
            raise ValueError('response_format.json_schema.schema must be a JSON schema object')
        return GrammarSpec('json_schema', json.dumps(schema))  # (key order kept: properties come in it)
    if kind in ('regex', 'regex_schema'):
        pattern = fmt.get(kind)
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f'response_format.{kind} must be a non-empty regular expression')
        return GrammarSpec('regex', pattern)
    if kind == 'structural_tag':
        if not isinstance(fmt.get('format'), dict):
            raise ValueError('response_format.format must be a structural tag format object')
        return GrammarSpec('structural_tag', json.dumps({'type': 'structural_tag', 'format': fmt['format']}))
    raise ValueError(f'response_format.type {kind!r} is not one of "text", "json_object", "json_schema", '
                     '"regex", "structural_tag"')


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError('response_format (structured output) needs the xgrammar package: '
                         "pip install 'lmdeploy[structured]'") from None
    return xgrammar


def _reason(e: Exception) -> str:
    """xgrammar's message without its time stamp and source position."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r'^\[[^\]]*\]\s*\S+:\d+:\s*', '', first)


def _fill_threads() -> int:
    """Threads that fill a batch's bitmask: $LMDEPLOY_GRAMMAR_THREADS (0 or 1: on the calling thread, one
    matcher after another, the default: on the H100 machine's CPU, 8 of xgrammar's threads filled 64 / 256
    masks in 4.03 / 8.15 ms against 3.78 / 6.80 ms one after another, benchmark/grammar_cost.py)."""
    import os
    return max(0, int(os.environ.get('LMDEPLOY_GRAMMAR_THREADS') or 0))


class Grammars:
    """Compiles specs for one tokenizer (each distinct spec once: xgrammar's compiler caches)."""

    def __init__(self, tokenizer, vocab_size: int):
        xgr = _xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info)
        self._threads = _fill_threads()
        self._batch_matcher = None

    def compile(self, spec: GrammarSpec):
        try:
            # JSON without free whitespace: a sampled model otherwise may pad it until max_tokens runs out
            if spec.kind == 'json':  # OpenAI's JSON mode: an object
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == 'json_schema':
                return self._compiler.compile_json_schema(spec.text, any_whitespace=False)
            if spec.kind == 'regex':
                return self._compiler.compile_regex(spec.text)
            if spec.kind == 'structural_tag':
                return self._compiler.compile_structural_tag(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {'json_schema': 'JSON schema', 'regex': 'regular expression',
                    'structural_tag': 'structural tag (a tool\'s parameters schema?)'}.get(spec.kind, 'grammar')
            raise ValueError(f'response_format: the {what} cannot be used: {_reason(e)}') from None
        raise ValueError(f'unknown grammar kind {spec.kind!r}')

    def matcher(self, spec: GrammarSpec):
        return self._xgr.GrammarMatcher(self.compile(spec))

    def bitmask(self, matchers: List[Any]) -> torch.Tensor:
        """int32 [len(matchers), ceil(vocab / 32)] on the host: bit j of word w allows token 32 w + j."""
        mask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(matchers) < 8 or self._threads <= 1:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(mask, i)
        else:  # on xgrammar's threads (they run without the interpreter lock)
            if self._batch_matcher is None:
                self._batch_matcher = self._xgr.BatchGrammarMatcher(max_threads=self._threads)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, mask)
        return mask
