import random

import pytest

from lmdeploy.frontend.detokenizer import IncrementalDetokenizer


def full_decode(tokenizer, ids, skip_special_tokens=True):
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(detok, ids, chunk_sizes=None):
    """Feed ids in chunks; return the deltas, finish() included."""
    deltas, i = [], 0
    rng = random.Random(0)
    while i < len(ids):
        n = rng.choice(chunk_sizes) if chunk_sizes else 1
        deltas.append(detok.step(ids[i:i + n]))
        i += n
    deltas.append(detok.finish())
    return deltas


HARD_TEXTS = [
    '你好，世界！这是一个测试。',
    'Emoji: 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 done',
    'Mixed 中文 and English, 日本語のテキスト, 한국어, العربية, Ελληνικά … “quotes” — dash',
    '  leading spaces\n\ttabs and\nnew lines  ',
    'def f(x):\n    return x ** 2  # 平方 🚀\n',
    '𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 and combining é (e\u0301)',
]


@pytest.mark.parametrize('text', HARD_TEXTS)
@pytest.mark.parametrize('chunks', [None, [1, 2, 3, 5]])
def test_stream_joins_to_full_decode(tokenizer, text, chunks):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream(detok, ids, chunks)
    assert ''.join(deltas) == full_decode(tokenizer, ids) == text
    assert all('\ufffd' not in d for d in deltas)
    assert detok.text == text
    assert detok.token_ids == ids


def test_incomplete_character_is_held_back(tokenizer):
    ids = tokenizer.encode('好', add_special_tokens=False)
    if len(ids) < 2:
        pytest.skip('this tokenizer has a single token for 好')
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.step([i]) for i in ids[:-1]] == [''] * (len(ids) - 1)
    assert detok.step(ids[-1:]) == '好'
    # an incomplete character left at the end is flushed as decode() renders it
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.step(ids[:1]) == ''
    assert detok.finish() == full_decode(tokenizer, ids[:1]) == '\ufffd'
    assert detok.finish() == ''
    with pytest.raises(RuntimeError):
        detok.step(ids[1:])


@pytest.mark.parametrize('skip', [True, False])
def test_random_ids_join_to_full_decode(tokenizer, skip):
    rng = random.Random(1234)
    vocab = len(tokenizer)
    special = tokenizer.all_special_ids
    pieces = tokenizer.encode(''.join(HARD_TEXTS), add_special_tokens=False)
    fffd_runs = 0
    for _ in range(40):
        # half arbitrary ids, half pieces of multi-byte characters in random order
        ids = [rng.randrange(vocab) if rng.random() < 0.5 else rng.choice(pieces)
               for _ in range(rng.randrange(1, 60))]
        if rng.random() < 0.5:  # sprinkle special tokens in
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        deltas = stream(detok, ids, [1, 1, 2, 4])
        assert ''.join(deltas) == full_decode(tokenizer, ids, skip) == detok.text
        # a character still arriving is never emitted as U+FFFD; only finish() may end with one
        assert not any(d.endswith('\ufffd') for d in deltas[:-1])
        fffd_runs += '\ufffd' in detok.text
    assert fffd_runs > 10  # the random ids did exercise broken UTF-8


def test_special_tokens(tokenizer):
    ids = tokenizer.encode('Hi there', add_special_tokens=False) + [tokenizer.eos_token_id]
    skipped = ''.join(stream(IncrementalDetokenizer(tokenizer), ids))
    kept = ''.join(stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids))
    assert skipped == 'Hi there'
    assert kept == 'Hi there' + tokenizer.eos_token


@pytest.mark.parametrize('spaces', [True, False])
def test_spaces_between_special_tokens_fast_tokenizer(tokenizer, spaces):
    """Fast tokenizers write added tokens verbatim whatever the flag; the stream matches decode."""
    im_end = tokenizer.convert_tokens_to_ids('<|im_end|>')
    ids = tokenizer.encode('a', add_special_tokens=False) + [im_end, im_end]
    ids += tokenizer.encode('b', add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    out = ''.join(stream(detok, ids))
    assert out == tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert out == 'a<|im_end|><|im_end|>b'


class SlowStyleTokenizer:
    """Characters by code point, plus id 1000 = '<sep>'; decode() honours
    spaces_between_special_tokens the way transformers 4's slow tokenizers do."""
    SEP = 1000

    def __init__(self):
        self.calls = []

    def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True):
        self.calls.append(len(ids))
        parts, cur = [], ''
        for i in ids:
            if i == self.SEP:
                if skip_special_tokens:
                    continue
                parts += [cur] if cur else []
                parts.append('<sep>')
                cur = ''
            else:
                cur += chr(i)
        parts += [cur] if cur else []
        return (' ' if spaces_between_special_tokens else '').join(parts)


@pytest.mark.parametrize('spaces, expected', [(True, 'ab <sep> <sep> cd'), (False, 'ab<sep><sep>cd')])
def test_spaces_between_special_tokens_is_passed_to_decode(spaces, expected):
    tok = SlowStyleTokenizer()
    ids = [ord('a'), ord('b'), tok.SEP, tok.SEP, ord('c'), ord('d')]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert ''.join(stream(detok, ids)) == expected == tok.decode(ids, False, spaces)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True, spaces_between_special_tokens=spaces)
    assert ''.join(stream(detok, ids)) == 'abcd'


def test_decode_cost_stays_small():
    """Each step decodes a window of a few tokens, not the whole output."""
    tok = SlowStyleTokenizer()
    detok = IncrementalDetokenizer(tok)
    text = 'lorem ipsum dolor sit amet ' * 40
    out = ''.join(stream(detok, [ord(c) for c in text]))
    assert out == text
    assert max(tok.calls) <= 3


def test_long_stream_window_bounded(tokenizer):
    calls = []
    real_decode = tokenizer.decode

    class Counting:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return real_decode(ids, **kw)

    text = '流式输出需要正确处理多字节字符 🙂 and words. ' * 30
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ''.join(stream(IncrementalDetokenizer(Counting()), ids)) == text
    assert len(ids) > 300 and max(calls) <= 8


def test_prompt_context(tokenizer):
    prompt = tokenizer.encode('<|im_start|>assistant\nSure', add_special_tokens=False)
    out = tokenizer.encode(' thing, 好的 👍', add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    text = ''.join(stream(detok, out))
    assert text == ' thing, 好的 👍'
    assert text == full_decode(tokenizer, prompt + out)[len(full_decode(tokenizer, prompt)):]
    assert detok.token_ids == out
