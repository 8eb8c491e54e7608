"""Chat templates: turn OpenAI-style messages into one prompt string.

Two kinds exist:

* builtin templates (``llama3``, ``chatml``, ...) are plain data, the fields of
  :class:`ChatTemplateConfig`, rendered by one generic renderer;
* :class:`HFChatTemplate` runs the jinja template shipped with the tokenizer.

Conventions shared by both, which the engine relies on:

* A prompt never carries a BOS the tokenizer would add itself: encode the
  prompt of a new sequence with ``add_special_tokens=True`` and a continuation
  (``sequence_start=False``) with ``add_special_tokens=False``.
* In an interactive session the KV cache holds the history up to and including
  the stop word that ended the last reply (e.g. ``<|im_end|>``), so a
  continuation starts with whatever the template puts after that stop word.
* Every prompt ends with the assistant generation prompt.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

Messages = Union[str, Sequence[Dict[str, Any]]]

_TEMPLATE_FIELDS = ('system', 'meta_instruction', 'eosys', 'user', 'eoh', 'assistant', 'eoa', 'separator')
_CAPABILITIES = (None, 'chat', 'completion')


@dataclass
class ChatTemplateConfig:
    """A builtin template by name, optionally with some fields overridden, or a
    custom template given entirely by its fields (LMDeploy's field names).

    system/eosys wrap a system turn, user/eoh a user turn, assistant/eoa an
    assistant turn; separator follows every finished assistant turn (after its
    eoa); meta_instruction is the default system prompt used when the messages
    have none. capability='completion' renders a plain-string prompt verbatim.
    """
    model_name: str
    system: Optional[str] = None
    meta_instruction: Optional[str] = None
    eosys: Optional[str] = None
    user: Optional[str] = None
    eoh: Optional[str] = None
    assistant: Optional[str] = None
    eoa: Optional[str] = None
    separator: Optional[str] = None
    capability: Optional[str] = None
    stop_words: Optional[List[str]] = None

    def __post_init__(self):
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f'ChatTemplateConfig.model_name must be a non-empty string, got {self.model_name!r}')
        for name in _TEMPLATE_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f'ChatTemplateConfig.{name} must be a string or None, got {value!r}')
        if self.capability not in _CAPABILITIES:
            raise ValueError(f'ChatTemplateConfig.capability must be one of {_CAPABILITIES}, got {self.capability!r}')
        if isinstance(self.stop_words, str):
            self.stop_words = [self.stop_words]
        if self.stop_words is not None and not (isinstance(self.stop_words, (list, tuple))
                                                and all(isinstance(w, str) and w for w in self.stop_words)):
            raise ValueError(f'ChatTemplateConfig.stop_words must be a list of non-empty strings, '
                             f'got {self.stop_words!r}')
        if self.stop_words is not None:
            self.stop_words = list(self.stop_words)
        if _builtin_key(self.model_name) is None and not self._overrides():
            raise ValueError(f'unknown chat template {self.model_name!r} and no template fields given; '
                             f'builtin templates: {", ".join(list_builtin_templates())}')

    def _overrides(self) -> Dict[str, Any]:
        names = _TEMPLATE_FIELDS + ('capability', 'stop_words')
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @classmethod
    def from_json(cls, path_or_json_str: str) -> 'ChatTemplateConfig':
        """Build from a JSON file path or a JSON string (LMDeploy's ``--chat-template`` file)."""
        if os.path.isfile(path_or_json_str):
            with open(path_or_json_str, encoding='utf-8') as f:
                text = f.read()
        else:
            text = path_or_json_str
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f'chat template is neither a file nor valid JSON: {e}') from e
        if not isinstance(data, dict):
            raise ValueError(f'chat template JSON must be an object, got {type(data).__name__}')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f'unknown chat template fields {unknown}; known: {sorted(known)}')
        if 'model_name' not in data:
            raise ValueError('chat template JSON needs a "model_name"')
        return cls(**data)

    def to_template(self) -> 'ChatTemplate':
        """The template this config describes: builtin fields, then overrides."""
        key = _builtin_key(self.model_name)
        fields = dict(BUILTIN_CHAT_TEMPLATES[key]) if key is not None else {}
        fields.update(self._overrides())
        return ChatTemplate(name=self.model_name, **fields)


class ChatTemplate:
    """Renders messages with the generic turn format (see ChatTemplateConfig).

    Subclasses override :meth:`_render`. Roles are system, user and assistant;
    'tool' turns (and an assistant's ``tool_calls``) are folded into these as
    text (see :meth:`messages2prompt`).
    """
    roles = ('system', 'user', 'assistant')

    def __init__(self, name: str = 'base', system: str = '', meta_instruction: Optional[str] = None,
                 eosys: str = '', user: str = '', eoh: str = '', assistant: str = '', eoa: str = '',
                 separator: str = '', capability: Optional[str] = None, stop_words: Optional[List[str]] = None):
        self.name = name
        self.system, self.meta_instruction, self.eosys = system, meta_instruction, eosys
        self.user, self.eoh = user, eoh
        self.assistant, self.eoa, self.separator = assistant, eoa, separator
        self.capability = capability
        self._stop_words = list(stop_words) if stop_words is not None else None

    @property
    def stop_words(self) -> List[str]:
        """Strings that end a reply; defaults to the end-of-assistant marker."""
        if self._stop_words is not None:
            return list(self._stop_words)
        return [self.eoa.strip()] if self.eoa.strip() else []

    def messages2prompt(self, messages: Messages, sequence_start: bool = True, tools: Optional[List[Dict]] = None,
                        tool_format=None) -> str:
        """Render ``messages`` (a user string or a list of role/content dicts).

        With ``sequence_start=False`` the messages are the new turns of a
        session whose history already sits in the KV cache: no default system
        prompt is added and the text starts where the last reply's stop word
        ended.

        ``tools`` (OpenAI tool objects) are described to the model; assistant
        turns may carry ``tool_calls`` and ``tool`` turns give their results.
        A template without tool support gets them as text written the way
        ``tool_format`` (a :class:`~lmdeploy.frontend.tool_calls.ToolFormat`;
        default: the template's own) writes calls.
        """
        if isinstance(messages, str) and self.capability == 'completion':
            return messages
        if tools or _has_tool_turns(messages):
            return self._render_tools(messages, sequence_start, tools or [], tool_format or self.tool_format)
        return self._render(normalize_messages(messages, self.roles), sequence_start)

    @property
    def tool_format(self):
        """How the model this template is for writes tool calls."""
        from .tool_calls import detect_format
        return detect_format(model_type={'qwen': 'qwen2', 'qwen2': 'qwen2', 'qwen2.5': 'qwen2', 'qwen3': 'qwen3',
                                         'internlm2': 'internlm2', 'internlm3': 'internlm2',
                                         'llama3': 'llama'}.get(self.name))

    def _render_tools(self, messages: Messages, sequence_start: bool, tools: List[Dict], fmt) -> str:
        """Tools and tool turns as plain text: the tools' description joins the system prompt, calls and
        results become the text the model writes and reads."""
        messages = _fold_tool_turns(messages, fmt)
        if tools:
            listing = fmt.system_prompt(tools)
            if messages and messages[0]['role'] == 'system':
                system = _content_text(messages[0].get('content'), 0)
                messages = [{'role': 'system', 'content': f'{system}\n\n{listing}' if system else listing}] \
                    + messages[1:]
            else:
                default = self.meta_instruction if sequence_start else None
                messages = [{'role': 'system', 'content': f'{default}\n\n{listing}' if default else listing}] \
                    + messages
        return self._render(normalize_messages(messages, self.roles), sequence_start)

    def _render(self, messages: List[Dict[str, str]], sequence_start: bool) -> str:
        box = {'system': (self.system, self.eosys), 'user': (self.user, self.eoh),
               'assistant': (self.assistant, self.eoa + self.separator)}
        # A system prefix that opens the user turn (llama2's "[INST] <<SYS>>")
        # merges with the first user turn, so that turn loses its own prefix.
        merge_system = bool(self.user) and self.system.startswith(self.user)
        parts = [] if sequence_start else [self.separator]
        if sequence_start and self.meta_instruction is not None and messages[0]['role'] != 'system':
            messages = [{'role': 'system', 'content': self.meta_instruction}] + messages
        prev = None
        for m in messages:
            begin, end = box[m['role']]
            if merge_system and prev == 'system' and m['role'] == 'user':
                begin = ''
            parts += [begin, m['content'], end]
            prev = m['role']
        parts.append(self.assistant)
        return ''.join(parts)

    def __repr__(self):
        return f'{type(self).__name__}({self.name!r})'


def _content_text(content: Any, index: int) -> str:
    """OpenAI content: a string, None, or a list of parts of which only text is supported."""
    if content is None:
        return ''
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get('type') == 'text' and isinstance(part.get('text'), str):
                texts.append(part['text'])
            elif isinstance(part, dict) and part.get('type') == 'text':
                raise ValueError(f'messages[{index}].content[{j}]: a text part needs "text", a string; got '
                                 f'{type(part.get("text")).__name__ if "text" in part else "none"}')
            else:
                kind = part.get('type') if isinstance(part, dict) else type(part).__name__
                raise ValueError(f'messages[{index}].content: unsupported content part {kind!r}; '
                                 'only text parts are supported')
        # Like other OpenAI-compatible servers: separate parts by a newline.
        return '\n'.join(texts)
    raise ValueError(f'messages[{index}].content must be a string or a list of text parts, '
                     f'got {type(content).__name__}')


def _has_tool_turns(messages: Messages) -> bool:
    return isinstance(messages, (list, tuple)) and any(
        isinstance(m, dict) and (m.get('role') == 'tool' or m.get('tool_calls')) for m in messages)


def _fold_tool_turns(messages: Messages, fmt) -> List[Dict[str, Any]]:
    """Messages without tool turns: an assistant's ``tool_calls`` follow its text as the model writes
    them, a ``tool`` message becomes a user turn holding the result."""
    if isinstance(messages, str):
        return [{'role': 'user', 'content': messages}]
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)  # normalize_messages says what is wrong
            continue
        calls = m.get('tool_calls')
        if m.get('role') == 'tool':
            out.append({'role': 'user', 'content': fmt.result_text(_content_text(m.get('content'), i))})
        elif calls and m.get('role') == 'assistant':
            text = _content_text(m.get('content'), i)
            calls_text = fmt.calls_text(_check_calls(calls, i))
            out.append({'role': 'assistant', 'content': f'{text}\n{calls_text}' if text else calls_text})
        else:
            out.append(m)
    return out


def _check_calls(calls: Any, index: int) -> List[Dict[str, Any]]:
    """An assistant turn's ``tool_calls``: OpenAI's ``[{"id", "type", "function": {"name", "arguments"}}]``."""
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get('function'), dict) and isinstance(c['function'].get('name'), str)
        and isinstance(c['function'].get('arguments', '{}'), (str, dict)) for c in calls)
    if not ok:
        raise ValueError(f'messages[{index}].tool_calls must be a list of {{"id", "type": "function", "function": '
                         '{"name", "arguments"}}')
    return calls


def normalize_messages(messages: Messages, roles: Sequence[str]) -> List[Dict[str, str]]:
    """Validate and reduce messages to ``[{'role': str, 'content': str}]``."""
    if isinstance(messages, str):
        return [{'role': 'user', 'content': messages}]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError('messages must be a string or a non-empty list of {"role", "content"} dicts')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or 'role' not in m:
            raise ValueError(f'messages[{i}] must be a dict with "role" and "content", got {m!r}')
        if m['role'] not in roles:
            raise ValueError(f'messages[{i}].role must be one of {list(roles)}, got {m["role"]!r}')
        out.append({'role': m['role'], 'content': _content_text(m.get('content'), i)})
    return out


class HFChatTemplate(ChatTemplate):
    """The tokenizer's own jinja chat template.

    Continuations (``sequence_start=False``) are rendered by putting a dummy
    user/assistant exchange in front of the new messages and keeping what the
    template writes after the dummy reply, minus the stop word the model
    generated to end it. This also drops any default system prompt, date
    header or BOS the template injects at the start of a conversation.
    """
    roles = ('system', 'user', 'assistant', 'tool')  # the template decides what it supports
    _DUMMY_USER = 'lmdeploy-dummy-question-7f3a'
    _DUMMY_REPLY = 'lmdeploy-dummy-reply-7f3a'

    def __init__(self, tokenizer, eos_token_ids: Optional[Sequence[int]] = None):
        if not getattr(tokenizer, 'chat_template', None):
            raise ValueError('the tokenizer has no chat template; use a builtin one via ChatTemplateConfig')
        super().__init__(name='hf')
        self.tokenizer = tokenizer
        self._stop_ids = _eos_ids(tokenizer, eos_token_ids)
        tokens = tokenizer.convert_ids_to_tokens(self._stop_ids)
        self._stop_words = list(dict.fromkeys(t for t in tokens if t))
        bos = getattr(tokenizer, 'bos_token', None)
        # Drop the template's BOS only where encoding would add another one.
        self._bos_to_strip = bos if bos and _encode_adds_bos(tokenizer) else None

    @property
    def stop_token_ids(self) -> List[int]:
        return list(self._stop_ids)

    @property
    def supports_tools(self) -> bool:
        """Whether the template renders ``tools`` itself (else they go into the system prompt as text)."""
        return 'tools' in self.tokenizer.chat_template and 'tool_calls' in self.tokenizer.chat_template

    @property
    def tool_format(self):
        from .tool_calls import detect_format
        return detect_format(self.tokenizer.chat_template)

    def _render_tools(self, messages, sequence_start, tools, fmt):
        if not self.supports_tools:
            return super()._render_tools(messages, sequence_start, tools, fmt)
        return self._render(_hf_tool_messages(normalize_messages(messages, self.roles), messages), sequence_start,
                            tools=tools or None)

    def _apply(self, messages, add_generation_prompt=True, tools=None) -> str:
        import jinja2
        try:
            extra = {'tools': tools} if tools else {}
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **extra)
        except jinja2.TemplateError as e:
            raise ValueError(f'chat template rejected the messages: {e}') from e

    def _render(self, messages, sequence_start, tools=None):
        if sequence_start:
            prompt = self._apply(messages, tools=tools)
            if self._bos_to_strip and prompt.startswith(self._bos_to_strip):
                prompt = prompt[len(self._bos_to_strip):]
            return prompt
        dummy = [{'role': 'user', 'content': self._DUMMY_USER}, {'role': 'assistant', 'content': self._DUMMY_REPLY}]
        full = self._apply(dummy + messages, tools=tools)
        pos = full.find(self._DUMMY_REPLY)
        if pos < 0:
            raise ValueError('this chat template cannot render a continuation (sequence_start=False): '
                             'it drops earlier assistant turns')
        rest = full[pos + len(self._DUMMY_REPLY):]
        for word in self._stop_words:
            if rest.startswith(word):
                return rest[len(word):]
        return rest


def _hf_tool_messages(normalized: List[Dict[str, str]], messages: Messages) -> List[Dict[str, Any]]:
    """Normalized messages plus what HF templates read of tool turns: an assistant's ``tool_calls``
    (arguments as objects, as those templates expect) and a tool message's ``tool_call_id`` / ``name``."""
    if isinstance(messages, str):
        return normalized
    out = []
    for i, (n, m) in enumerate(zip(normalized, messages)):
        n = dict(n)
        if m.get('tool_calls') and n['role'] == 'assistant':
            n['tool_calls'] = [{'id': c.get('id'), 'type': 'function',
                                'function': {'name': c['function']['name'],
                                             'arguments': _args_object(c['function'].get('arguments'), i)}}
                               for c in _check_calls(m['tool_calls'], i)]
        if n['role'] == 'tool':
            n.update({k: m[k] for k in ('tool_call_id', 'name') if isinstance(m.get(k), str)})
        out.append(n)
    return out


def _args_object(arguments: Any, index: int) -> Any:
    if isinstance(arguments, dict) or arguments is None:
        return arguments or {}
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        raise ValueError(f'messages[{index}].tool_calls: arguments must be a JSON object (as text), '
                         f'got {arguments[:80]!r}') from None


def _eos_ids(tokenizer, extra: Optional[Sequence[int]]) -> List[int]:
    """EOS ids from the tokenizer, the model's generation_config.json and ``extra``."""
    ids = []
    if getattr(tokenizer, 'eos_token_id', None) is not None:
        ids.append(tokenizer.eos_token_id)
    path = os.path.join(str(getattr(tokenizer, 'name_or_path', '') or ''), 'generation_config.json')
    if os.path.isfile(path):
        try:
            with open(path, encoding='utf-8') as f:
                eos = json.load(f).get('eos_token_id')
        except (OSError, ValueError):
            eos = None
        ids += [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
    ids += list(extra or [])
    return list(dict.fromkeys(ids))


def _encode_adds_bos(tokenizer) -> bool:
    bos_id = getattr(tokenizer, 'bos_token_id', None)
    if bos_id is None:
        return False
    try:
        return tokenizer.encode('a', add_special_tokens=True)[:1] == [bos_id]
    except Exception:  # a tokenizer without a usable encode: assume it adds nothing
        return False


def _chatml(meta_instruction=None, stop_words=('<|im_end|>', )):
    return dict(system='<|im_start|>system\n', meta_instruction=meta_instruction, eosys='<|im_end|>\n',
                user='<|im_start|>user\n', eoh='<|im_end|>\n', assistant='<|im_start|>assistant\n',
                eoa='<|im_end|>', separator='\n', stop_words=list(stop_words))


_INTERNLM2_META = ('You are an AI assistant whose name is InternLM (书生·浦语).\n'
                   '- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI '
                   'Laboratory (上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n'
                   '- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by the '
                   'user such as English and 中文.')

# name -> ChatTemplate keyword arguments; all rendered by ChatTemplate._render.
BUILTIN_CHAT_TEMPLATES: Dict[str, Dict[str, Any]] = {
    'base': dict(),
    'chatml': _chatml(),
    'qwen': _chatml('You are a helpful assistant.'),
    'qwen2': _chatml('You are a helpful assistant.'),
    'qwen2.5': _chatml('You are Qwen, created by Alibaba Cloud. You are a helpful assistant.'),
    'qwen3': _chatml(),
    # InternLM2 / 2.5 chat: the checkpoints' template is ChatML after BOS; LMDeploy adds InternLM's default
    # system prompt where the messages bring none. InternLM3-8B-Instruct keeps the turns and that prompt.
    'internlm2': _chatml(_INTERNLM2_META, stop_words=('<|im_end|>', '<|action_end|>')),
    'internlm3': _chatml(_INTERNLM2_META, stop_words=('<|im_end|>', '<|action_end|>')),
    # Gemma (1, 2, 3; the assistant is "model"): no system turn. A system message is folded into the first
    # user turn, followed by a blank line, as Gemma 3's template does (Gemma 1 and 2 refuse one). Gemma's
    # template also trims each message's surrounding whitespace; this one keeps the content as given.
    'gemma': dict(system='<start_of_turn>user\n', eosys='\n\n', user='<start_of_turn>user\n',
                  eoh='<end_of_turn>\n', assistant='<start_of_turn>model\n', eoa='<end_of_turn>', separator='\n',
                  stop_words=['<end_of_turn>']),
    # Phi-3 / Phi-3.5 (mini, medium): <|role|> on its own line, every turn closed by <|end|> and a newline
    'phi-3': dict(system='<|system|>\n', eosys='<|end|>\n', user='<|user|>\n', eoh='<|end|>\n',
                  assistant='<|assistant|>\n', eoa='<|end|>', separator='\n', stop_words=['<|end|>', '<|endoftext|>']),
    'llama3': dict(system='<|start_header_id|>system<|end_header_id|>\n\n', eosys='<|eot_id|>',
                   user='<|start_header_id|>user<|end_header_id|>\n\n', eoh='<|eot_id|>',
                   assistant='<|start_header_id|>assistant<|end_header_id|>\n\n', eoa='<|eot_id|>',
                   stop_words=['<|eot_id|>', '<|end_of_text|>']),
    # <s> before every later [INST]: the tokenizer adds only the first one.
    'llama2': dict(system='[INST] <<SYS>>\n', eosys='\n<</SYS>>\n\n', user='[INST] ', eoh=' [/INST]',
                   assistant=' ', eoa='</s>', separator='<s>', stop_words=['</s>']),
    # Mistral has no system turn: the system prompt opens the first [INST].
    'mistral': dict(system='[INST] ', eosys='\n\n', user='[INST] ', eoh=' [/INST]', assistant='', eoa='</s>',
                    stop_words=['</s>']),
    # GLM-4 (glm-4-9b-chat's turn markers, as LMDeploy's glm4): its tokenizers add the [gMASK]<sop> prefix as
    # special tokens, which a new sequence is encoded with
    'glm4': dict(system='<|system|>\n', user='<|user|>\n', assistant='<|assistant|>\n',
                 stop_words=['<|user|>', '<|endoftext|>', '<|observation|>']),
    # Baichuan2: generation_config's user_token_id 195 and assistant_token_id 196 are these pieces; a system
    # prompt goes first as plain text; a reply ends at EOS (build_chat_input in its generation_utils.py)
    'baichuan2': dict(user='<reserved_106>', assistant='<reserved_107>'),
    'vicuna': dict(meta_instruction='A chat between a curious user and an artificial intelligence assistant. '
                   "The assistant gives helpful, detailed, and polite answers to the user's questions.",
                   eosys=' ', user='USER: ', eoh=' ', assistant='ASSISTANT: ', eoa='</s>', stop_words=['</s>']),
}


# other spellings of builtin names (LMDeploy's and the families' own)
_ALIASES = {'phi3': 'phi-3', 'gemma2': 'gemma', 'gemma3': 'gemma', 'llama-3': 'llama3', 'llama-2': 'llama2',
            'internlm2_5': 'internlm2', 'internlm2.5': 'internlm2'}


def _builtin_key(name: str) -> Optional[str]:
    key = name.lower() if isinstance(name, str) else None
    key = _ALIASES.get(key, key)
    return key if key in BUILTIN_CHAT_TEMPLATES else None


def list_builtin_templates() -> List[str]:
    return sorted(BUILTIN_CHAT_TEMPLATES)


def get_chat_template(config: Union[ChatTemplateConfig, str, None] = None, tokenizer=None,
                      model_path: Optional[str] = None, model_type: Optional[str] = None) -> ChatTemplate:
    """The template to use: ``config`` if given (a config or a builtin name),
    else the tokenizer's own template, else the builtin that the model's name or
    ``model_type`` suggests (template_match.py), else 'base' (no decoration)."""
    if isinstance(config, str):
        config = ChatTemplateConfig(model_name=config)
    if config is not None:
        return config.to_template()
    if tokenizer is not None and getattr(tokenizer, 'chat_template', None):
        return HFChatTemplate(tokenizer)
    if model_path is None and model_type is None:
        return ChatTemplateConfig(model_name='base').to_template()
    from .template_match import pick_builtin
    return ChatTemplateConfig(model_name=pick_builtin(model_path, model_type)).to_template()
