"""A request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked: what the model is told
and whether its reply must be calls (then a grammar forces them, so the reply always parses)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .formats import ToolFormat

NAME_PATTERN = r'^[A-Za-z0-9_.\-]{1,64}$'  # a function's name (the server's schema says it too)
_NAME = re.compile(NAME_PATTERN)
MAX_TOOLS = 128
_CHOICE_SHAPE = ('tool_choice is "none", "auto", "required" or names a function as {"type": "function", '
                 '"function": {"name": ...}}')


class ToolError(ValueError):
    """An invalid ``tools`` / ``tool_choice``; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolRequest:
    tools: List[Dict[str, Any]]  # OpenAI tool objects: {"type": "function", "function": {...}}
    choice: str  # 'auto', 'none', 'required' or 'named'
    name: Optional[str] = None  # the function a 'named' choice calls
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the model is told about the tools and its reply parsed for calls."""
        return bool(self.tools) and self.choice != 'none'

    @property
    def forced(self) -> bool:
        return self.choice in ('required', 'named')

    def functions(self) -> List[Dict[str, Any]]:
        fns = [t['function'] for t in self.tools]
        return [f for f in fns if f['name'] == self.name] if self.choice == 'named' else fns

    def response_format(self, fmt: ToolFormat) -> Optional[Dict[str, Any]]:
        """The grammar (as a response_format) that makes every reply calls, when calls are forced."""
        if not (self.active and self.forced):
            return None
        return fmt.structural_tag(self.functions(), parallel=self.parallel and self.choice == 'required')


def _check_tool(i: int, tool: Any) -> Dict[str, Any]:
    where = f'tools[{i}]'
    if not isinstance(tool, dict) or tool.get('type', 'function') != 'function':
        raise ToolError(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                        'tools')
    fn = tool.get('function')
    if not isinstance(fn, dict):
        raise ToolError(f'{where}.function must be an object with a "name"', 'tools')
    name = fn.get('name')
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(f'{where}.function.name must be 1 to 64 letters, digits, underscores, dots or dashes, '
                        f'got {name!r}', 'tools')
    params = fn.get('parameters')
    if params is not None and not isinstance(params, dict):
        raise ToolError(f'{where}.function.parameters must be a JSON schema object', 'tools')
    if fn.get('description') is not None and not isinstance(fn['description'], str):
        raise ToolError(f'{where}.function.description must be a string', 'tools')
    out = {k: v for k, v in fn.items() if v is not None}
    return {'type': 'function', 'function': out}


def check_tools(tools: Optional[List[Any]], tool_choice: Any = None,
                parallel_tool_calls: Optional[bool] = None) -> ToolRequest:
    """Raises :class:`ToolError` with OpenAI-like messages."""
    if tools is not None and not isinstance(tools, list):
        raise ToolError('tools must be a list of function tools', 'tools')
    tools = [_check_tool(i, t) for i, t in enumerate(tools or [])]
    if len(tools) > MAX_TOOLS:
        raise ToolError(f'at most {MAX_TOOLS} tools per request, got {len(tools)}', 'tools')
    names = [t['function']['name'] for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ToolError(f'tools: function names must be unique; repeated: {", ".join(dup)}', 'tools')
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        return ToolRequest(tools, 'auto' if tools else 'none', parallel=parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in ('none', 'auto', 'required'):
            raise ToolError(f'{_CHOICE_SHAPE}; got {tool_choice!r}', 'tool_choice')
        if tool_choice == 'required' and not tools:
            raise ToolError('tool_choice "required" needs tools', 'tool_choice')
        return ToolRequest(tools, tool_choice, parallel=parallel)
    if not isinstance(tool_choice, dict):
        raise ToolError(_CHOICE_SHAPE, 'tool_choice')
    fn = tool_choice.get('function')
    name = fn.get('name') if isinstance(fn, dict) else None
    if tool_choice.get('type', 'function') != 'function' or not isinstance(name, str):
        raise ToolError(_CHOICE_SHAPE, 'tool_choice')
    if name not in names:
        known = ', '.join(names) if names else 'none are given'
        raise ToolError(f'tool_choice names the function {name!r}, which is not in tools ({known})', 'tool_choice')
    return ToolRequest(tools, 'named', name, parallel)
