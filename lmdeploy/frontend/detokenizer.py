"""Streaming detokenization.

Byte-level BPE splits one character (a CJK ideograph, an emoji) over several
tokens, and decoding a token on its own gives U+FFFD or nothing useful. So
:class:`IncrementalDetokenizer` decodes a small window of recent tokens and
emits only text that is final: the window ``ids[prefix_offset:]`` is decoded
next to ``ids[prefix_offset:read_offset]`` (text already emitted), and the
difference is emitted once it no longer ends in U+FFFD (an incomplete
character). Both offsets then move forward, so a step costs a decode of a few
tokens, not of the whole output. Starting the window a token early also keeps
decoders that drop a leading space (SentencePiece's "▁") from dropping it
mid-text.

The deltas joined together (after :meth:`finish`) equal
``tokenizer.decode(output_ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False)``. When ``prompt_ids`` are given, the
output is decoded in the context of the prompt's last tokens, so a reply that
starts with a word keeps its leading space.

``clean_up_tokenization_spaces`` is never applied: that heuristic rewrites
" ." to "." across token boundaries, which a stream cannot take back.
"""
from __future__ import annotations

import inspect
from typing import List, Optional, Sequence

_REPLACEMENT = '\ufffd'
_PROMPT_CONTEXT = 5  # prompt tokens decoded in front of the output


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text deltas.

    skip_special_tokens: leave special tokens (e.g. ``<|im_end|>``) out of the text.
    spaces_between_special_tokens: passed to ``tokenizer.decode`` when its
        signature names it; it asks slow tokenizers to put a space around
        special/added tokens. Fast tokenizers (and all of transformers 5) write
        added tokens verbatim and ignore it, so the text equals their decode.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 prompt_ids: Optional[Sequence[int]] = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._decode_kwargs = dict(skip_special_tokens=skip_special_tokens)
        if _accepts(tokenizer.decode, 'clean_up_tokenization_spaces'):
            self._decode_kwargs['clean_up_tokenization_spaces'] = False
        if _accepts(tokenizer.decode, 'spaces_between_special_tokens', strict=True) or \
                _accepts(getattr(tokenizer, '_decode', None), 'spaces_between_special_tokens', strict=True):
            self._decode_kwargs['spaces_between_special_tokens'] = spaces_between_special_tokens
        # _ids = prompt context + output; offsets index into _ids.
        self._ids: List[int] = [int(i) for i in (prompt_ids or [])][-_PROMPT_CONTEXT:]
        self._num_context = len(self._ids)
        self.prefix_offset = 0
        self.read_offset = self._num_context
        self._chunks: List[str] = []
        self._finished = False

    @property
    def token_ids(self) -> List[int]:
        """All output token ids seen so far (no prompt ids)."""
        return self._ids[self._num_context:]

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return ''.join(self._chunks)

    def _decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, **self._decode_kwargs) if ids else ''

    def step(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete ('' if none yet)."""
        if self._finished:
            raise RuntimeError('step() after finish()')
        self._ids.extend(int(i) for i in new_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """Flush text held back for an incomplete character (it stays U+FFFD)."""
        if self._finished:
            return ''
        delta = self._advance(final=True)
        self._finished = True
        return delta

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self._ids):
            return ''
        done = self._decode(self._ids[self.prefix_offset:self.read_offset])
        window = self._decode(self._ids[self.prefix_offset:])
        if not final and (len(window) <= len(done) or window.endswith(_REPLACEMENT)
                          or not window.startswith(done)):
            # Nothing final yet: an incomplete character, or only skipped
            # special tokens (kept in the window as context).
            return ''
        delta = window[len(done):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        if delta:
            self._chunks.append(delta)
        return delta


def _accepts(fn, name: str, strict: bool = False) -> bool:
    """Whether ``fn`` takes keyword ``name``; with strict, a bare **kwargs does not count."""
    if fn is None:
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if name in params:
        return True
    return not strict and any(p.kind is p.VAR_KEYWORD for p in params.values())
