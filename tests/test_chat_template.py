import json

import pytest

from lmdeploy.frontend.chat_template import (BUILTIN_CHAT_TEMPLATES, ChatTemplate, ChatTemplateConfig,
                                             HFChatTemplate, get_chat_template, list_builtin_templates)


def tmpl(name, **overrides) -> ChatTemplate:
    return ChatTemplateConfig(model_name=name, **overrides).to_template()


HISTORY = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
CONVERSATION = HISTORY + [{'role': 'assistant', 'content': 'Hello!'}, {'role': 'user', 'content': 'Bye'}]

# ---------------------------------------------------------------- builtins


def test_builtin_names():
    names = list_builtin_templates()
    for name in ('llama3', 'llama2', 'chatml', 'qwen', 'qwen2', 'qwen2.5', 'qwen3', 'internlm2', 'vicuna',
                 'mistral', 'base'):
        assert name in names
    assert names == sorted(BUILTIN_CHAT_TEMPLATES)


def test_chatml_exact():
    t = tmpl('chatml')
    assert t.messages2prompt('Hi') == '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n'
    assert t.messages2prompt(CONVERSATION) == ('<|im_start|>system\nBe brief.<|im_end|>\n'
                                               '<|im_start|>user\nHi<|im_end|>\n'
                                               '<|im_start|>assistant\nHello!<|im_end|>\n'
                                               '<|im_start|>user\nBye<|im_end|>\n'
                                               '<|im_start|>assistant\n')
    assert t.stop_words == ['<|im_end|>']


def test_qwen_default_system_prompt():
    expected = ('<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'
                '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n')
    assert tmpl('qwen').messages2prompt('Hi') == expected
    assert tmpl('qwen2').messages2prompt('Hi') == expected
    assert tmpl('qwen2.5').messages2prompt('Hi').startswith('<|im_start|>system\nYou are Qwen, created by')
    # an explicit system message replaces the default one
    assert tmpl('qwen').messages2prompt(HISTORY) == tmpl('chatml').messages2prompt(HISTORY)
    assert tmpl('qwen3').messages2prompt('Hi') == tmpl('chatml').messages2prompt('Hi')


def test_internlm2():
    t = tmpl('internlm2')
    prompt = t.messages2prompt('Hi')
    assert prompt.startswith('<|im_start|>system\nYou are an AI assistant whose name is InternLM (书生·浦语).')
    assert prompt.endswith('中文.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n')
    assert t.stop_words == ['<|im_end|>', '<|action_end|>']


def test_llama3_exact():
    t = tmpl('llama3')
    assert t.messages2prompt(CONVERSATION) == (
        '<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>'
        '<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>'
        '<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>'
        '<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>'
        '<|start_header_id|>assistant<|end_header_id|>\n\n')
    assert '<|eot_id|>' in t.stop_words
    assert t.messages2prompt('Bye', sequence_start=False) == (
        '<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>'
        '<|start_header_id|>assistant<|end_header_id|>\n\n')


def test_llama2_exact():
    t = tmpl('llama2')
    assert t.messages2prompt(CONVERSATION) == ('[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello!</s>'
                                               '<s>[INST] Bye [/INST] ')
    assert t.messages2prompt('Hi') == '[INST] Hi [/INST] '
    assert t.messages2prompt('Bye', sequence_start=False) == '<s>[INST] Bye [/INST] '
    assert t.stop_words == ['</s>']


def test_mistral_exact():
    t = tmpl('mistral')
    assert t.messages2prompt(CONVERSATION) == '[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] Bye [/INST]'
    assert t.messages2prompt('Hi') == '[INST] Hi [/INST]'


def test_vicuna_exact():
    t = tmpl('vicuna')
    meta = BUILTIN_CHAT_TEMPLATES['vicuna']['meta_instruction']
    assert t.messages2prompt('Hi') == f'{meta} USER: Hi ASSISTANT: '
    assert t.messages2prompt(CONVERSATION) == 'Be brief. USER: Hi ASSISTANT: Hello!</s>USER: Bye ASSISTANT: '


def test_base_is_raw_concatenation():
    t = tmpl('base')
    assert t.messages2prompt('The capital of France is') == 'The capital of France is'
    assert t.messages2prompt(CONVERSATION) == 'Be brief.HiHello!Bye'
    assert t.stop_words == []


@pytest.mark.parametrize('name', sorted(BUILTIN_CHAT_TEMPLATES))
def test_builtin_continuation_matches_full_render(name):
    """History prompt + reply + stop word + continuation == the whole conversation rendered at once."""
    t = tmpl(name)
    new = [{'role': 'user', 'content': 'Bye'}]
    cont = t.messages2prompt(new, sequence_start=False)
    assert t.messages2prompt(HISTORY) + 'Hello!' + t.eoa + cont == t.messages2prompt(CONVERSATION)
    # no default system prompt in a continuation, and a str means one user turn
    if t.meta_instruction:
        assert t.meta_instruction not in cont
    assert t.messages2prompt('Bye', sequence_start=False) == cont


def test_chatml_continuation_exact():
    assert tmpl('qwen').messages2prompt('Bye', sequence_start=False) == \
        '\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n'


def test_content_parts_are_joined():
    t = tmpl('chatml')
    parts = [{'role': 'user', 'content': [{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}]}]
    assert t.messages2prompt(parts) == t.messages2prompt('a\nb')
    with pytest.raises(ValueError, match='image_url'):
        t.messages2prompt([{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'x'}}]}])
    # a text part without its text is not "an unsupported part": the error says what it lacks
    for part, got in (({'type': 'text'}, 'none'), ({'type': 'text', 'text': 5}, 'int')):
        with pytest.raises(ValueError, match=rf'messages\[0\]\.content\[1\]: a text part needs "text", a string; '
                                             rf'got {got}'):
            t.messages2prompt([{'role': 'user', 'content': [{'type': 'text', 'text': 'a'}, part]}])


@pytest.mark.parametrize('messages, match', [
    ([], 'non-empty'),
    (None, 'non-empty'),
    ([{'content': 'x'}], 'role'),
    (['hello'], 'role'),
    ([{'role': 'robot', 'content': 'x'}], 'robot'),
    ([{'role': 'user', 'content': 3}], 'content'),
])
def test_invalid_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        tmpl('chatml').messages2prompt(messages)


# ---------------------------------------------------------------- config


def test_unknown_name_lists_builtins():
    with pytest.raises(ValueError, match='llama3') as e:
        ChatTemplateConfig(model_name='no-such-model')
    assert 'chatml' in str(e.value)


def test_custom_template_from_fields():
    t = tmpl('my-model', user='Q: ', eoh='\n', assistant='A: ', eoa='<end>', separator='\n')
    assert t.messages2prompt([{'role': 'user', 'content': 'x'}, {'role': 'assistant', 'content': 'y'},
                              {'role': 'user', 'content': 'z'}]) == 'Q: x\nA: y<end>\nQ: z\nA: '
    assert t.stop_words == ['<end>']  # defaults to eoa


def test_builtin_with_overrides():
    t = tmpl('qwen', meta_instruction='Answer in French.', stop_words='<|endoftext|>')
    assert t.messages2prompt('Hi') == ('<|im_start|>system\nAnswer in French.<|im_end|>\n'
                                       '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n')
    assert t.stop_words == ['<|endoftext|>']
    assert tmpl('QWEN').messages2prompt('Hi') == tmpl('qwen').messages2prompt('Hi')


def test_completion_capability_keeps_raw_prompt():
    assert tmpl('llama3', capability='completion').messages2prompt('Once upon') == 'Once upon'


@pytest.mark.parametrize('kwargs, match', [
    (dict(model_name=''), 'model_name'),
    (dict(model_name='chatml', user=1), 'user'),
    (dict(model_name='chatml', stop_words=['']), 'stop_words'),
    (dict(model_name='chatml', capability='vision'), 'capability'),
])
def test_invalid_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ChatTemplateConfig(**kwargs)


def test_from_json(tmp_path):
    data = {'model_name': 'llama3', 'meta_instruction': 'Be nice.'}
    cfg = ChatTemplateConfig.from_json(json.dumps(data))
    assert cfg == ChatTemplateConfig(model_name='llama3', meta_instruction='Be nice.')
    path = tmp_path / 'tmpl.json'
    path.write_text(json.dumps(data))
    assert ChatTemplateConfig.from_json(str(path)) == cfg
    with pytest.raises(ValueError, match='valid JSON'):
        ChatTemplateConfig.from_json('{not json')
    with pytest.raises(ValueError, match='colour'):
        ChatTemplateConfig.from_json('{"model_name": "chatml", "colour": "red"}')
    with pytest.raises(ValueError, match='model_name'):
        ChatTemplateConfig.from_json('{"user": "Q: "}')


def test_get_chat_template_selection(tokenizer):
    assert isinstance(get_chat_template(None, tokenizer), HFChatTemplate)
    assert get_chat_template(None, None).messages2prompt('x') == 'x'

    class NoTemplate:
        chat_template = None

    assert get_chat_template(None, NoTemplate()).name == 'base'
    assert get_chat_template(ChatTemplateConfig('llama3'), tokenizer).name == 'llama3'
    assert get_chat_template('chatml').messages2prompt('x') == tmpl('chatml').messages2prompt('x')


# ---------------------------------------------------------------- HF template

HF_CASES = [
    'Hi',
    [{'role': 'user', 'content': 'Hi'}],
    HISTORY,
    CONVERSATION,
    [{'role': 'user', 'content': '你好 😀'}, {'role': 'assistant', 'content': '好'},
     {'role': 'user', 'content': 'ok'}],
]


@pytest.mark.parametrize('messages', HF_CASES)
def test_hf_matches_apply_chat_template(tokenizer, messages):
    t = HFChatTemplate(tokenizer)
    as_list = [{'role': 'user', 'content': messages}] if isinstance(messages, str) else messages
    assert t.messages2prompt(messages) == tokenizer.apply_chat_template(as_list, tokenize=False,
                                                                        add_generation_prompt=True)


def test_hf_continuation(tokenizer):
    t = HFChatTemplate(tokenizer)
    new = [{'role': 'user', 'content': 'Bye'}]
    cont = t.messages2prompt(new, sequence_start=False)
    stop = t.stop_words[0]
    assert t.messages2prompt(HISTORY) + 'Hello!' + stop + cont == t.messages2prompt(CONVERSATION)
    # SmolLM2's template injects a default system prompt for a first turn; a continuation has none.
    assert 'system' in t.messages2prompt(new)
    assert cont == '\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n'
    assert t.messages2prompt('Bye', sequence_start=False) == cont


def test_hf_content_parts_and_errors(tokenizer):
    t = HFChatTemplate(tokenizer)
    parts = [{'role': 'user', 'content': [{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}]}]
    assert t.messages2prompt(parts) == t.messages2prompt('a\nb')
    with pytest.raises(ValueError):
        t.messages2prompt([])
    with pytest.raises(ValueError):
        t.messages2prompt([{'role': 'user', 'content': [{'type': 'image_url'}]}])


def test_hf_stop_words(tokenizer):
    t = HFChatTemplate(tokenizer)
    assert t.stop_words == ['<|im_end|>']
    assert t.stop_token_ids == [tokenizer.convert_tokens_to_ids('<|im_end|>')]
    extra = tokenizer.convert_tokens_to_ids('<|endoftext|>')
    t = HFChatTemplate(tokenizer, eos_token_ids=[extra])
    assert t.stop_words == ['<|im_end|>', '<|endoftext|>']


def test_hf_requires_template():

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match='no chat template'):
        HFChatTemplate(NoTemplate())


class _BosTokenizer:
    """A Llama-style tokenizer: its template writes BOS and encode() adds one too."""
    chat_template = 'x'
    bos_token, bos_token_id, eos_token_id, name_or_path = '<s>', 1, 2, ''

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return '<s>' + ''.join(f'[{m["role"]}]{m["content"]}</s>' for m in messages) + '[assistant]'

    def encode(self, text, add_special_tokens=True):
        return [1, 5] if add_special_tokens else [5]

    def convert_ids_to_tokens(self, ids):
        return ['</s>' if i == 2 else '?' for i in ids]


def test_hf_strips_bos_the_tokenizer_adds():
    t = HFChatTemplate(_BosTokenizer())
    assert t.messages2prompt('Hi') == '[user]Hi</s>[assistant]'
    assert t.messages2prompt('Bye', sequence_start=False) == '[user]Bye</s>[assistant]'
    assert t.stop_words == ['</s>']
