"""Tool calling: how model families write calls (:mod:`.formats`), splitting replies into text and
calls as they stream (:mod:`.parser`), and checking a request's ``tools`` / ``tool_choice``
(:mod:`.request`)."""
from .formats import FORMATS, ToolFormat, detect_format, get_format
from .parser import CallDelta, ToolCall, ToolCallParser, assemble, parse

__all__ = ['FORMATS', 'ToolFormat', 'detect_format', 'get_format', 'CallDelta', 'ToolCall', 'ToolCallParser',
           'assemble', 'parse']
