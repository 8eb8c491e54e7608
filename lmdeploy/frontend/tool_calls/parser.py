"""Splits a reply into text and tool calls, as it streams.

:class:`ToolCallParser` takes the reply's text in pieces and gives back events: text (a ``str``) and
:class:`CallDelta` s. A call's first delta carries its id and name; the ones after carry pieces of
its arguments, which are the model's own JSON text of the arguments object (never re-serialized),
so the pieces join into exactly what a whole-text parse gives: how the text was cut into pieces
never changes the result (:func:`parse` is the same parser fed once).

Text next to calls loses the whitespace that separates it from them; a reply without calls comes
through unchanged. A block that opens like a call but holds no ``"name"`` is given back as text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from .formats import ToolFormat

_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*(?=\S)')
_DECODER = json.JSONDecoder()


@dataclass
class CallDelta:
    index: int  # the call's place in the reply: 0, 1, ...
    id: Optional[str] = None  # with the name, on a call's first delta
    name: Optional[str] = None
    arguments: str = ''


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


Event = Union[str, CallDelta]


def new_call_id() -> str:
    return f'call_{uuid.uuid4().hex[:24]}'


@dataclass
class _Call:
    args_start: Optional[int] = None  # where the arguments' value starts in the buffer
    args_end: Optional[int] = None  # where it ends, once it has
    args_sent: int = 0  # the buffer up to here has been sent as arguments
    index: Optional[int] = None  # set when its name is sent


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (and may become it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _decode_end(text: str, start: int) -> Optional[int]:
    """Where the JSON value at ``start`` ends, once it is complete (a number never is: it may go on)."""
    if start >= len(text) or text[start] in '-0123456789':
        return None
    try:
        return _DECODER.raw_decode(text, start)[1]
    except json.JSONDecodeError:
        return None


class ToolCallParser:

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self._buf = ''
        self._call: Optional[_Call] = None
        self._named = 0  # calls with a name sent
        self._after_call = False  # text right after a call: its leading whitespace goes
        self._plain = False  # (calls without markers) the rest of the reply is text
        self._after_separator = False

    @property
    def calls(self) -> int:
        return self._named

    def feed(self, text: str) -> List[Event]:
        self._buf += text
        out: List[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> List[Event]:
        """The events the rest of the reply makes, once it has ended."""
        out: List[Event] = []
        while self._step(out):
            pass
        if self._call is not None:
            self._end_call(out, self._buf)
            self._buf = ''
        rest, self._buf = self._buf, ''
        if self._named:  # after calls: no trailing whitespace, nor the start of a call cut off by the end
            rest = rest.rstrip()
            if self.fmt.open and self.fmt.open.startswith(rest.lstrip()):
                rest = ''
        self._text(out, rest)
        return out

    # ------------------------------------------------------------------ text
    def _text(self, out: List[Event], text: str):
        if self._after_call:
            text = text.lstrip()
        if text:
            self._after_call = False
            if out and isinstance(out[-1], str):
                out[-1] += text
            else:
                out.append(text)

    def _step(self, out: List[Event]) -> bool:
        """Consume what the buffer decides; True if the state changed and another step may go on."""
        if self._call is not None:
            return self._step_call(out)
        if self._plain:
            self._text(out, self._buf)
            self._buf = ''
            return False
        return self._step_marked(out) if self.fmt.open else self._step_bare(out)

    def _step_marked(self, out: List[Event]) -> bool:
        buf, marker = self._buf, self.fmt.open
        i = buf.find(marker)
        if i >= 0:
            self._text(out, buf[:i].rstrip())
            self._buf = buf[i + len(marker):]
            self._call = _Call()
            return True
        head = buf[:len(buf) - _partial(buf, marker)]
        sent = head.rstrip()  # whitespace waits: it goes if a call follows
        self._text(out, sent)
        self._buf = buf[len(sent):]
        return False

    def _step_bare(self, out: List[Event]) -> bool:
        """Calls without markers: the reply (after any prefix) is ``{...}`` objects joined by a separator."""
        s = self._buf.lstrip()
        prefix = self.fmt.prefix
        if prefix and s.startswith(prefix):
            s = s[len(prefix):].lstrip()
        elif prefix and s and prefix.startswith(s):
            return False  # may be the prefix
        sep = self.fmt.separator.strip()
        if self._named and not self._after_separator and sep and s.startswith(sep):
            self._buf, self._after_separator = s[len(sep):], True
            return True
        if not s:
            return False
        if s[0] == '{' and (self._named == 0 or self._after_separator):
            self._buf, self._after_separator = s, False
            self._call = _Call()
            return True
        self._plain = True
        if self._named:  # text after the calls
            self._buf = s
        return True

    # ----------------------------------------------------------------- calls
    def _step_call(self, out: List[Event]) -> bool:
        c, buf, close = self._call, self._buf, self.fmt.close
        if c.args_start is None and (m := _ARGS.search(buf)):
            c.args_start = c.args_sent = m.end()
        if c.index is None and (m := _NAME.search(buf)):
            self._name(out, c, json.loads(m.group(1)))
        if c.args_start is not None and c.args_end is None:
            c.args_end = _decode_end(buf, c.args_start)
        if c.index is not None and c.args_start is not None:
            if c.args_end is not None:
                upto = c.args_end
            else:  # all of it is the value so far, but for whitespace and what may begin the close marker
                t = buf.rstrip()
                upto = len(t) - (_partial(t, close) if close else 0)
            self._args(out, c, buf, upto)
        if close:
            j = buf.find(close, c.args_end if c.args_end is not None else (c.args_start or 0))
            if j < 0:
                return False
            self._end_call(out, buf[:j])
            self._buf = buf[j + len(close):]
            return True
        end = _decode_end(buf, 0)
        if end is None:
            return False
        self._end_call(out, buf[:end])
        self._buf = buf[end:]
        return True

    def _name(self, out: List[Event], c: _Call, name: str):
        c.index = self._named
        self._named += 1
        out.append(CallDelta(c.index, new_call_id(), name))

    def _args(self, out: List[Event], c: _Call, buf: str, upto: int):
        if upto > c.args_sent:
            out.append(CallDelta(c.index, arguments=buf[c.args_sent:upto]))
            c.args_sent = upto

    def _end_call(self, out: List[Event], body: str):
        c, self._call = self._call, None
        if c.index is None:
            try:
                obj = json.loads(body.strip())
            except json.JSONDecodeError:
                obj = None
            if not (isinstance(obj, dict) and isinstance(obj.get('name'), str)):  # not a call: text
                self._text(out, self.fmt.open + body + self.fmt.close if self.fmt.open else body)
                if not self.fmt.open:
                    self._plain = True
                return
            self._name(out, c, obj['name'])
        if c.args_start is None:
            self._args(out, c, '{}', 2)
        else:
            end = c.args_end if c.args_end is not None else len(body.rstrip())
            self._args(out, c, body, end)
        self._after_call = True


def parse(fmt: ToolFormat, text: str) -> Tuple[str, List[ToolCall]]:
    """A whole reply: its text and its calls."""
    p = ToolCallParser(fmt)
    return assemble(p.feed(text) + p.finish())


def assemble(events: List[Event]) -> Tuple[str, List[ToolCall]]:
    """Join events: the text and the calls they make."""
    text, calls = [], []
    for e in events:
        if isinstance(e, str):
            text.append(e)
        elif e.id is not None:
            calls.append(ToolCall(e.id, e.name, e.arguments))
        else:
            calls[e.index].arguments += e.arguments
    return ''.join(text), calls
