"""Tool calling without a model: the formats' parsers (whole and streamed in random pieces), the checks
of tools / tool_choice, the templates' rendering of tools and tool turns, and the grammar that forces
calls (xgrammar with SmolLM2's tokenizer)."""
from __future__ import annotations

import json
import random

import pytest

from lmdeploy.frontend.chat_template import ChatTemplateConfig, HFChatTemplate, get_chat_template
from lmdeploy.frontend.tool_calls import FORMATS, ToolCallParser, assemble, detect_format, get_format, parse
from lmdeploy.frontend.tool_calls.request import ToolError, check_tools

WEATHER = {'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'The weather in a city',
    'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}, 'days': {'type': 'integer'}},
                   'required': ['city']}}}
TIME = {'type': 'function', 'function': {'name': 'get_time'}}


def _random_args(rng: random.Random) -> str:
    """The JSON text of a random arguments object: nesting, escapes, braces and markers inside strings."""
    def value(depth):
        kind = rng.choice(['s', 'i', 'f', 'b', 'l', 'o'] if depth < 2 else ['s', 'i', 'b'])
        if kind == 's':
            return ''.join(rng.choice(['a', ' ', '}', '{', '"', '\\', '\n', 'é', '<tool_call>', ';', 'x'])
                           for _ in range(rng.randint(0, 8)))
        if kind == 'i':
            return rng.randint(-1000, 1000)
        if kind == 'f':
            return rng.random() * 100
        if kind == 'b':
            return rng.choice([True, False, None])
        if kind == 'l':
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {f'k{i}': value(depth + 1) for i in range(rng.randint(0, 3))}
    obj = {f'p{i}': value(0) for i in range(rng.randint(0, 4))}
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))


def _feed_in_pieces(fmt, text: str, rng: random.Random):
    p = ToolCallParser(fmt)
    events, k = [], 0
    while k < len(text):
        n = rng.randint(1, 7)
        events += p.feed(text[k:k + n])
        k += n
    return assemble(events + p.finish())


def _plain(result):
    text, calls = result
    return text, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize('name', sorted(FORMATS))
def test_random_calls_parse_the_same_whole_or_streamed(name):
    """Random replies (text, then calls written as the format writes them): the calls come back with the
    model's exact argument text, whole or fed in random pieces (fresh seed each run)."""
    fmt = FORMATS[name]
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(60):
        calls = [(rng.choice(['get_weather', 'f', 'a.b-c_d']), _random_args(rng)) for _ in range(rng.randint(1, 3))]
        lead = rng.choice(['', 'Let me check. ', 'Sure:\n']) if fmt.open else ''
        text = lead + fmt.separator.join(fmt.call_text(n, a) for n, a in calls)
        expected = (lead.strip(), calls)
        assert _plain(parse(fmt, text)) == expected, (seed, text)
        assert _plain(_feed_in_pieces(fmt, text, rng)) == expected, (seed, text)
        for c in parse(fmt, text)[1]:
            assert c.id.startswith('call_') and json.loads(c.arguments) is not None


@pytest.mark.parametrize('name', sorted(FORMATS))
def test_replies_without_calls_come_through_unchanged(name):
    fmt = FORMATS[name]
    rng = random.Random(random.randrange(1 << 30))
    for text in ['The weather is nice.', '  leading and trailing spaces  ', 'a < b and <tool and <|act',
                 '{"answer": 42}' if fmt.open else 'Paris {is} "nice"', '']:
        assert _plain(parse(fmt, text)) == (text, [])
        assert _plain(_feed_in_pieces(fmt, text, rng)) == (text, [])


def test_qwen_edge_cases():
    fmt = FORMATS['qwen']
    # arguments before the name: the call still parses (its first delta waits for the name)
    text, calls = parse(fmt, '<tool_call>\n{"arguments": {"x": "a}b"}, "name": "late"}\n</tool_call>')
    assert text == '' and [(c.name, c.arguments) for c in calls] == [('late', '{"x": "a}b"}')]
    # a block that is no call is text; text after calls keeps its words
    assert _plain(parse(fmt, '<tool_call>\nnot json\n</tool_call>')) == ('<tool_call>\nnot json\n</tool_call>', [])
    assert _plain(parse(fmt, fmt.call_text('f', '{}') + '\nDone.')) == ('Done.', [('f', '{}')])
    # a call cut off by max_tokens keeps what was written; one without arguments gets {}
    assert _plain(parse(fmt, '<tool_call>\n{"name": "f", "arguments": {"a": 1')) == ('', [('f', '{"a": 1')])
    assert _plain(parse(fmt, '<tool_call>\n{"name": "f"}\n</tool_call>')) == ('', [('f', '{}')])


def test_streamed_deltas_follow_openai():
    """The first delta of a call has id and name (no arguments yet unless they came with it); later ones
    only arguments; indexes count calls."""
    fmt = FORMATS['qwen']
    p = ToolCallParser(fmt)
    text = 'Hi.' + fmt.call_text('f', '{"a": [1, 2]}') + '\n' + fmt.call_text('g', '{}')
    events = []
    for ch in text:
        events += p.feed(ch)
    events += p.finish()
    deltas = [e for e in events if not isinstance(e, str)]
    firsts = [e for e in deltas if e.id is not None]
    assert [(e.index, e.name, e.arguments) for e in firsts] == [(0, 'f', ''), (1, 'g', '')]
    assert all(e.name is None for e in deltas if e.id is None)
    assert ''.join(e.arguments for e in deltas if e.index == 0) == '{"a": [1, 2]}'
    assert len([e for e in deltas if e.index == 0]) > 3  # the arguments really stream
    assert ''.join(e for e in events if isinstance(e, str)) == 'Hi.'


def test_llama3_bare_json_and_separator():
    fmt = FORMATS['llama3']
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert _plain(parse(fmt, text)) == ('', [('a', '{"x": 1}'), ('b', '{}')])
    assert _plain(parse(fmt, '{"answer": 42}')) == ('{"answer": 42}', [])
    assert _plain(parse(fmt, 'Sure {"name": "a", "parameters": {}}')) == ('Sure {"name": "a", "parameters": {}}', [])


def test_format_names_and_detection():
    assert get_format('hermes') is FORMATS['qwen'] and get_format('Llama3.1') is FORMATS['llama3']
    with pytest.raises(ValueError, match='unknown tool-call parser'):
        get_format('gpt')
    assert detect_format('... <tool_call> ...').name == 'qwen'
    assert detect_format('<|action_start|><|plugin|>').name == 'internlm2'
    assert detect_format('{{ "<|python_tag|>" }}').name == 'llama3'
    assert detect_format('', 'llama').name == 'llama3' and detect_format('', 'qwen2').name == 'qwen'
    assert detect_format('', 'internlm2').name == 'internlm2' and detect_format('', 'gpt2').name == 'qwen'


@pytest.mark.parametrize('tools,choice,match', [
    ('f', None, 'list'),
    ([{'type': 'retrieval'}], None, r'tools\[0\]'),
    ([{'type': 'function'}], None, 'function must be an object'),
    ([{'type': 'function', 'function': {'name': 'has space'}}], None, 'name'),
    ([{'type': 'function', 'function': {'name': 'x' * 65}}], None, 'name'),
    ([{'type': 'function', 'function': {'name': 'f', 'parameters': []}}], None, 'parameters'),
    ([TIME, TIME], None, 'unique'),
    (None, 'required', 'needs tools'),
    ([TIME], 'sometimes', 'tool_choice'),
    ([TIME], {'type': 'function', 'function': {'name': 'nope'}}, "'nope', which is not in tools"),
    ([TIME], {'type': 'function'}, 'tool_choice'),
    ([TIME], 3, 'tool_choice'),
])
def test_invalid_tools(tools, choice, match):
    with pytest.raises(ToolError, match=match) as e:
        check_tools(tools, choice)
    assert e.value.param in ('tools', 'tool_choice')


def test_tool_choice_modes():
    assert check_tools([WEATHER]).choice == 'auto' and check_tools(None).choice == 'none'
    assert not check_tools([WEATHER], 'none').active
    r = check_tools([WEATHER, TIME], {'type': 'function', 'function': {'name': 'get_time'}}, False)
    assert r.forced and [f['name'] for f in r.functions()] == ['get_time'] and not r.parallel
    assert check_tools([WEATHER, TIME], 'required').forced
    assert check_tools([WEATHER], 'auto').response_format(FORMATS['qwen']) is None


MESSAGES = [
    {'role': 'user', 'content': 'Weather in Paris?'},
    {'role': 'assistant', 'content': None, 'tool_calls': [
        {'id': 'call_1', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': '{"city": "Paris"}'}}]},
    {'role': 'tool', 'tool_call_id': 'call_1', 'content': 'sunny, 21 C'},
]


@pytest.mark.parametrize('name', ['qwen2.5', 'llama3', 'internlm2', 'chatml'])
def test_builtin_templates_render_tools_and_tool_turns(name):
    """A template without tool support gets the tools in its system prompt, the assistant's calls as the
    model writes them, and the tool's result as a turn the model reads."""
    template = get_chat_template(name)
    fmt = template.tool_format
    prompt = template.messages2prompt(MESSAGES, tools=[WEATHER])
    assert json.dumps(WEATHER) in prompt
    assert fmt.call_text('get_weather', '{"city": "Paris"}') in prompt
    assert prompt.index('Weather in Paris?') < prompt.index('"city": "Paris"') < prompt.index('sunny, 21 C')
    assert prompt.endswith(template.assistant)
    # the template's default system prompt stays, with the tools after it
    if template.meta_instruction:
        assert prompt.index(template.meta_instruction) < prompt.index(json.dumps(WEATHER))
    # without tools, calls and results still render (a conversation that used tools goes on without them)
    assert 'sunny, 21 C' in template.messages2prompt(MESSAGES)


def test_hf_template_with_tool_support_gets_tools_and_call_objects(tokenizer):
    """A template that renders tools itself (it mentions ``tools`` and ``tool_calls``) gets them as
    ``tools=`` and each call's arguments as an object, as HF templates expect."""
    import copy
    tok = copy.copy(tokenizer)
    tok.chat_template = (
        '{% if tools %}<|im_start|>system\nTOOLS={{ tools | map(attribute="function.name") | join(",") }}'
        '<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n'
        '{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments.city }}'
        '{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}'
        '{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}')
    template = HFChatTemplate(tok)
    assert template.supports_tools
    prompt = template.messages2prompt(MESSAGES, tools=[WEATHER, TIME])
    assert 'TOOLS=get_weather,get_time' in prompt and 'CALL get_weather Paris' in prompt
    assert '<|im_start|>tool\nsunny, 21 C' in prompt
    with pytest.raises(ValueError, match='arguments must be a JSON object'):
        bad = copy.deepcopy(MESSAGES)
        bad[1]['tool_calls'][0]['function']['arguments'] = '{"city": '
        template.messages2prompt(bad, tools=[WEATHER])


def test_hf_template_without_tool_support_gets_them_as_text(tokenizer):
    template = get_chat_template(tokenizer=tokenizer)  # SmolLM2's: chatml, no tools
    assert not template.supports_tools
    prompt = template.messages2prompt(MESSAGES, tools=[WEATHER], tool_format=FORMATS['llama3'])
    assert json.dumps(WEATHER) in prompt and '{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt


def test_custom_config_template_renders_tools():
    template = ChatTemplateConfig(model_name='mine', user='U:', eoh='\n', assistant='A:', eoa='\n',
                                  system='S:', eosys='\n').to_template()
    prompt = template.messages2prompt(MESSAGES, tools=[WEATHER], tool_format=FORMATS['qwen'])
    assert prompt.startswith('S:') and '<tool_response>\nsunny, 21 C\n</tool_response>' in prompt


@pytest.mark.parametrize('name', sorted(FORMATS))
def test_forcing_grammar_accepts_calls_and_nothing_else(name, tokenizer):
    """The grammar of tool_choice "required" takes one or more calls of the declared functions with
    arguments that fit their schemas, and then only the end; a named choice takes only its function."""
    pytest.importorskip('xgrammar')
    from lmdeploy.engine.grammar import Grammars, spec_from_response_format
    fmt = FORMATS[name]
    grammars = Grammars(tokenizer, len(tokenizer))

    def accepts(text, choice, parallel=True):
        spec = spec_from_response_format(check_tools([WEATHER, TIME], choice, parallel).response_format(fmt))
        m = grammars.matcher(spec)
        ok = all(m.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return ok and m.accept_token(tokenizer.eos_token_id)

    one = fmt.call_text('get_weather', '{"city": "Paris", "days": 3}')
    two = one + fmt.separator + fmt.call_text('get_time', '{}')
    assert accepts(one, 'required') and accepts(two, 'required')
    assert not accepts(two, 'required', parallel=False)
    assert not accepts('Sure! ' + one, 'required')
    assert not accepts(fmt.call_text('get_weather', '{"days": 3}'), 'required')  # city is required
    assert not accepts(fmt.call_text('get_weather', '{"city": 5}'), 'required')
    assert not accepts(fmt.call_text('nope', '{}'), 'required')
    named = {'type': 'function', 'function': {'name': 'get_time'}}
    assert accepts(fmt.call_text('get_time', '{}'), named) and not accepts(one, named)
