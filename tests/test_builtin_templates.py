"""Built-in chat templates for the families whose checkpoints may lack one, the choice of a built-in by model name
or model_type, and `lmdeploy list`.

References: each family's Jinja chat template as its checkpoint ships it in tokenizer_config.json, rendered by
transformers' ``apply_chat_template`` (the engine's convention: no leading BOS, which the tokenizer adds when it
encodes a new sequence):

* GEMMA3: google/gemma-3-*-it (system folded into the first user turn, ``model`` for the assistant);
* PHI3: microsoft/Phi-3-mini-4k-instruct;
* INTERNLM2: internlm/internlm2-chat-* and internlm2_5-*-chat (ChatML after BOS). LMDeploy's internlm2 template
  adds InternLM's default system prompt where the messages have none, so without a system message the reference
  is that template given the default prompt as the system message. internlm3 is checked against the same text
  (InternLM3-8B-Instruct's turns and suggested system prompt are InternLM2's).

The expected choices by name are LMDeploy's (``best_match_model``) for these checkpoints' hub names.
"""
from __future__ import annotations

import logging

import pytest

from lmdeploy import cli
from lmdeploy.engine.models import ARCHITECTURES
from lmdeploy.frontend.chat_template import (BUILTIN_CHAT_TEMPLATES, ChatTemplateConfig, HFChatTemplate,
                                             get_chat_template, list_builtin_templates)
from lmdeploy.frontend.template_match import match_template, model_name_of

GEMMA3 = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n")
PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
        "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}"
        "{% endif %}")
INTERNLM2 = ("{{ bos_token }}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
             "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
             "{{ '<|im_start|>assistant\n' }}{% endif %}")

SYSTEM = {'role': 'system', 'content': 'Be brief.'}
TURNS = [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello! How can I help?'},
         {'role': 'user', 'content': '你好, what is 2+2?'}]
CASES = [TURNS[:1], TURNS, [SYSTEM] + TURNS[:1], [SYSTEM] + TURNS]


def reference(tokenizer, jinja: str, messages, bos: str) -> str:
    text = tokenizer.apply_chat_template(messages, chat_template=jinja, tokenize=False, add_generation_prompt=True,
                                         bos_token=bos, eos_token='<eos>')
    return text[len(bos):] if text.startswith(bos) else text


@pytest.mark.parametrize('messages', CASES)
@pytest.mark.parametrize('name,jinja', [('gemma', GEMMA3), ('phi-3', PHI3)], ids=['gemma', 'phi-3'])
def test_builtin_renders_as_the_checkpoint_template(tokenizer, name, jinja, messages):
    ours = ChatTemplateConfig(name).to_template().messages2prompt(messages)
    assert ours == reference(tokenizer, jinja, messages, '<bos>')


@pytest.mark.parametrize('messages', CASES)
@pytest.mark.parametrize('name', ['internlm2', 'internlm3'])
def test_internlm_renders_as_the_checkpoint_template_with_its_system_prompt(tokenizer, name, messages):
    t = ChatTemplateConfig(name).to_template()
    with_system = messages if messages[0]['role'] == 'system' else \
        [{'role': 'system', 'content': t.meta_instruction}] + messages
    assert t.messages2prompt(messages) == reference(tokenizer, INTERNLM2, with_system, '<s>')
    assert t.stop_words == ['<|im_end|>', '<|action_end|>']


def test_gemma_continuation_and_stop_word(tokenizer):
    """A later turn of a session: what the reference writes after the first reply's <end_of_turn>."""
    t = ChatTemplateConfig('gemma').to_template()
    first = reference(tokenizer, GEMMA3, [SYSTEM] + TURNS[:1], '<bos>')
    full = reference(tokenizer, GEMMA3, [SYSTEM] + TURNS, '<bos>')
    reply = TURNS[1]['content'] + '<end_of_turn>'
    assert full == first + reply + t.messages2prompt(TURNS[2:], sequence_start=False)
    assert t.stop_words == ['<end_of_turn>']


def test_aliases():
    for alias, name in (('phi3', 'phi-3'), ('gemma2', 'gemma'), ('Gemma3', 'gemma'), ('llama-3', 'llama3'),
                        ('internlm2_5', 'internlm2')):
        assert ChatTemplateConfig(alias).to_template().messages2prompt(CASES[3]) == \
            ChatTemplateConfig(name).to_template().messages2prompt(CASES[3])


# ------------------------------------------------------------------ choosing one by name / model_type

@pytest.mark.parametrize('path,expected', [
    ('/models/internlm2_5-7b-chat', 'internlm2'),
    ('/models/internlm2-chat-20b', 'internlm2'),
    ('/models/internlm3-8b-instruct', 'internlm3'),
    ('/models/gemma-2-9b-it', 'gemma'),
    ('/models/gemma-3-1b-it', 'gemma'),
    ('/models/Phi-3.5-mini-instruct', 'phi-3'),
    ('/models/Phi-3-mini-4k-instruct', 'phi-3'),
    ('/models/glm-4-9b-chat', 'glm4'),
    ('/models/Baichuan2-7B-Chat', 'baichuan2'),
    ('/models/Qwen2.5-7B-Instruct', 'qwen2.5'),
    ('/models/Qwen1.5-7B-Chat', 'qwen2'),
    ('/models/Qwen3-8B', 'qwen3'),
    ('/models/Meta-Llama-3.1-8B-Instruct', 'llama3'),
    ('/models/Llama-2-7b-chat-hf', 'llama2'),
    ('/models/Mistral-7B-Instruct-v0.3', 'mistral'),
    ('/models/vicuna-7b-v1.5', 'vicuna'),
    # a hub cache snapshot is named by its hash: the repository's name counts
    ('/root/.cache/huggingface/hub/models--internlm--internlm2_5-7b-chat/snapshots/9b8d9553b0d8', 'internlm2'),
])
def test_match_by_name(path, expected):
    assert match_template(path, model_type='llama')[0] == expected


def test_match_by_model_type_then_base():
    assert match_template('/tmp/m', 'gemma3_text')[0] == 'gemma'
    assert match_template('/tmp/m', 'internlm2')[0] == 'internlm2'
    assert match_template('/tmp/m', 'phi3')[0] == 'phi-3'
    # one model type, several chat formats (and base models): no guess
    for model_type in ('llama', 'qwen2', 'mistral', None):
        assert match_template('/tmp/m', model_type)[0] == 'base'
    assert model_name_of('/a/b/models--org--Phi-3-mini/snapshots/abc/') == 'Phi-3-mini'


class _NoTemplate:
    chat_template = None


def test_get_chat_template_picks_logs_and_yields(tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        t = get_chat_template(None, _NoTemplate(), model_path='/models/internlm2_5-7b-chat', model_type='internlm2')
    assert t.name == 'internlm2'
    assert t.messages2prompt(CASES[3]) == ChatTemplateConfig('internlm2').to_template().messages2prompt(CASES[3])
    assert "built-in 'internlm2'" in caplog.text and "contains 'internlm2'" in caplog.text
    # --chat-template NAME overrides the match and the checkpoint's own template alike
    assert get_chat_template('gemma', _NoTemplate(), model_path='/models/internlm2_5-7b-chat').name == 'gemma'
    from lmdeploy.cli.common import parse_chat_template  # what --chat-template NAME gives the pipeline
    flag = parse_chat_template('phi-3')
    assert get_chat_template(flag, _NoTemplate(), model_path='/models/internlm2_5-7b-chat').name == 'phi-3'
    assert get_chat_template(ChatTemplateConfig('phi-3'), tokenizer, model_path='/m/gemma-2b-it').name == 'phi-3'
    # the checkpoint's own template wins over a name match
    assert isinstance(get_chat_template(None, tokenizer, model_path='/models/gemma-2-9b-it'), HFChatTemplate)


def test_pipeline_uses_the_matched_template(tiny_model_factory, tmp_path, caplog):
    """A checkpoint without a template of its own, in a directory named as InternLM2.5's chat model: the
    pipeline renders prompts with the internlm2 built-in and encodes them as that text."""
    import json
    import os
    import shutil

    from lmdeploy import PytorchEngineConfig, pipeline
    path = str(tmp_path / 'internlm2_5-tiny-chat')
    shutil.copytree(tiny_model_factory('llama'), path)
    if os.path.exists(os.path.join(path, 'chat_template.jinja')):
        os.remove(os.path.join(path, 'chat_template.jinja'))
    with open(os.path.join(path, 'tokenizer_config.json')) as f:
        tok_cfg = json.load(f)
    tok_cfg.pop('chat_template', None)
    with open(os.path.join(path, 'tokenizer_config.json'), 'w') as f:
        json.dump(tok_cfg, f)
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        pipe = pipeline(path, backend_config=PytorchEngineConfig(device_type='cpu', session_len=512), log_level='INFO')
    try:
        gateway = pipe.gateway
        assert not getattr(gateway.tokenizer, 'chat_template', None)
        assert gateway.chat_template.name == 'internlm2' and "built-in 'internlm2'" in caplog.text
        text = ChatTemplateConfig('internlm2').to_template().messages2prompt(CASES[2])
        assert gateway.encode_prompt(CASES[2]) == gateway.tokenizer.encode(text, add_special_tokens=False)
    finally:
        pipe.close()


# ------------------------------------------------------------------ lmdeploy list

def test_lmdeploy_list_prints_architectures_and_templates(capsys):
    assert cli.main(['list']) == 0
    out = capsys.readouterr().out
    arch_part, template_part = out.split('Built-in chat templates')
    assert arch_part.startswith('Supported architectures')
    assert [line.strip() for line in arch_part.splitlines()[1:]] == sorted(ARCHITECTURES)
    assert [line.strip() for line in template_part.splitlines()[1:]] == list_builtin_templates()
    for name in ('Gemma3ForCausalLM', 'InternLM2ForCausalLM', 'Phi3ForCausalLM', 'ChatGLMModel'):
        assert f'  {name}\n' in arch_part
    for name in ('internlm2', 'internlm3', 'gemma', 'phi-3', 'glm4', 'baichuan2', 'llama3', 'mistral', 'qwen'):
        assert name in BUILTIN_CHAT_TEMPLATES and f'  {name}\n' in template_part
