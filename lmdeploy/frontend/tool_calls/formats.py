"""How a model family writes tool calls: the markers around a call, the key of its arguments, the
text that describes the tools to a template that has no tool support, and the grammar that forces
calls (``tool_choice`` "required" or a named function).

A call is a JSON object ``{"name": NAME, "<args_key>": {...}}`` between ``begin`` and ``end`` (as the
model writes them; the parser looks for them without their surrounding whitespace):

* ``qwen`` (Qwen2.5, Qwen3, Hermes-style): ``<tool_call>\\n{...}\\n</tool_call>``, calls one per block;
* ``llama3`` (Llama 3.1 / 3.2 JSON): the reply is the bare object (``"parameters"``), calls joined by
  ``; ``; Llama's ``<|python_tag|>`` may open it;
* ``internlm2``: ``<|action_start|><|plugin|>\\n{...}<|action_end|>`` (``"parameters"``); its markers
  are special tokens, so its replies are decoded keeping special tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class ToolFormat:
    name: str
    begin: str  # '' : a call is a JSON object at the start of the reply
    end: str  # '' : the object's closing brace ends the call
    separator: str  # what the grammar writes between two calls
    args_key: str
    keeps_special_tokens: bool = False
    prefix: str = ''  # may stand before the first call (dropped when parsing)

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (``arguments``: JSON text of an object)."""
        return f'{self.begin}{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.args_key}": {arguments}}}' \
               f'{self.end}'

    @property
    def open(self) -> str:
        return self.begin.strip()

    @property
    def close(self) -> str:
        return self.end.strip()

    def calls_text(self, calls: List[Dict[str, Any]]) -> str:
        """An assistant turn's ``tool_calls`` (OpenAI's shape) as the model writes them."""
        return self.separator.join(self.call_text(c['function']['name'], _args_json(c['function'].get('arguments')))
                                   for c in calls)

    def result_text(self, content: str) -> str:
        """A tool's result, for templates whose turns have no tool role."""
        if self.name == 'qwen':
            return f'<tool_response>\n{content}\n</tool_response>'
        return content

    def system_prompt(self, tools: List[Dict[str, Any]]) -> str:
        """What tells a model whose template cannot render tools which ones it has and how to call them."""
        listing = '\n'.join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = self.call_text('<function name>', '<arguments as a JSON object>')
        how = 'one call per block' if self.open else f'several calls joined by "{self.separator}"'
        return ('You can call functions (tools) to help answer. Their signatures, one JSON object a line:\n'
                f'{listing}\n'
                f'To call a function, reply with exactly this and nothing else ({how}):\n{example}')

    def structural_tag(self, functions: List[Dict[str, Any]], parallel: bool) -> Dict[str, Any]:
        """An xgrammar structural tag whose every output is one call (or, ``parallel``, several) of one of
        ``functions`` (OpenAI ``function`` objects), arguments valid against their ``parameters``."""
        tags = []
        for f in functions:
            head, tail = self.call_text(f['name'], '\x00').split('\x00')
            schema = f.get('parameters') or {'type': 'object'}
            tags.append({'type': 'tag', 'begin': head, 'end': tail,
                         'content': {'type': 'json_schema', 'json_schema': schema, 'max_whitespace_cnt': 1}})
        return {'type': 'structural_tag', 'format': {
            'type': 'tags_with_separator', 'tags': tags, 'separator': self.separator, 'at_least_one': True,
            'stop_after_first': not parallel}}


def _args_json(arguments: Any) -> str:
    """OpenAI sends arguments as a JSON string; some clients send the object."""
    if arguments is None:
        return '{}'
    if isinstance(arguments, str):
        return arguments.strip() or '{}'
    return json.dumps(arguments, ensure_ascii=False)


FORMATS: Dict[str, ToolFormat] = {
    'qwen': ToolFormat('qwen', '<tool_call>\n', '\n</tool_call>', '\n', 'arguments'),
    'llama3': ToolFormat('llama3', '', '', '; ', 'parameters', prefix='<|python_tag|>'),
    'internlm2': ToolFormat('internlm2', '<|action_start|><|plugin|>\n', '<|action_end|>', '\n', 'parameters',
                            keeps_special_tokens=True),
}
ALIASES = {'hermes': 'qwen', 'qwen2.5': 'qwen', 'qwen3': 'qwen', 'llama3.1': 'llama3', 'llama3.2': 'llama3',
           'llama3_json': 'llama3', 'internlm': 'internlm2'}


def get_format(name: str) -> ToolFormat:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in FORMATS:
        raise ValueError(f'unknown tool-call parser {name!r}; known: {", ".join(sorted(FORMATS))} (or auto)')
    return FORMATS[key]


_BY_MODEL_TYPE = {'qwen2': 'qwen', 'qwen2_moe': 'qwen', 'qwen3': 'qwen', 'qwen3_moe': 'qwen', 'llama': 'llama3',
                  'internlm2': 'internlm2', 'internlm3': 'internlm2'}


def detect_format(template_text: str = '', model_type: Optional[str] = None) -> ToolFormat:
    """The format a model writes: from its chat template's markers, else its model type, else qwen's
    (Hermes-style calls are what most recent instruction-tuned models write)."""
    text = template_text or ''
    if '<tool_call>' in text:
        return FORMATS['qwen']
    if '<|plugin|>' in text or '<|action_start|>' in text:
        return FORMATS['internlm2']
    if '<|python_tag|>' in text or 'ipython' in text:
        return FORMATS['llama3']
    return FORMATS[_BY_MODEL_TYPE.get(model_type or '', 'qwen')]
