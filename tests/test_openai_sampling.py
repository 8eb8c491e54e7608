"""The OpenAI sampling fields beyond the basics: ``echo`` with prompt logprobs (what evaluation harnesses
score with), ``frequency_penalty`` / ``presence_penalty`` and ``logit_bias``. Each is checked against a
direct computation: transformers' logits for the echoed prompt, the model's raw logits with OpenAI's formulas
applied by hand for the penalties and the bias."""
from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch

openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')
pytest.importorskip('fastapi')

from test_server import KEY, MODEL, assert_clean, start_server, stop_server  # noqa: E402

from lmdeploy.messages import GenerationConfig  # noqa: E402


@pytest.fixture(scope='module')
def srv(smollm2_path):
    s = start_server(smollm2_path)
    yield s
    stop_server(s)


@pytest.fixture(scope='module')
def client(srv):
    return openai.OpenAI(base_url=srv.url + '/v1', api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope='module')
def http(srv):
    with httpx.Client(base_url=srv.url, headers={'Authorization': f'Bearer {KEY}'}, timeout=120) as c:
        yield c


@pytest.fixture(scope='module')
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32).eval()


def _generate(srv, prompt: str, gen: GenerationConfig, **kwargs):
    """The gateway's outputs for one request, merged: (token ids, [raw logits row per token] or None, last)."""
    async def go():
        ids, rows, last = [], [], None
        async for out in srv.gateway.generate(prompt, srv.gateway.next_session_id(), gen, do_preprocess=False,
                                              **kwargs):
            ids += out.token_ids
            if out.logits is not None:
                rows.append(out.logits)
            last = out
        return ids, (torch.cat(rows) if rows else None), last
    return asyncio.run(go())


def _sentence(rng: random.Random) -> str:
    words = ['the', 'river', 'quietly', 'north', 'seven', 'bright', 'garden', 'because', 'stone', 'music',
             'under', 'window', 'Paris', 'ancient', 'number', 'cloud']
    return ' '.join(rng.choice(words) for _ in range(rng.randint(8, 20))) + '.'


# ----------------------------------------------------------------------- echo
def test_echo_logprobs_are_the_prompts_own(client, srv, hf_model):
    """Echo with logprobs: the prompt's tokens, each with transformers' logprob for it (first: null), and
    the same mean as get_ppl's loss; the completion follows with its own logprobs."""
    rng = random.Random()
    prompt = _sentence(rng)
    ids = srv.gateway.tokenizer.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=4, temperature=0,
                                  extra_body={'ignore_eos': True})
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(prompt) and len(c.text) > len(prompt)
    assert len(lp.tokens) == len(ids) + 4 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert ''.join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    ref = [float(want[k - 1, ids[k]]) for k in range(1, len(ids))]
    got = lp.token_logprobs[1:len(ids)]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 2e-3, (got, ref)
    for k in range(1, len(ids)):  # the top 3 alternatives are transformers' top 3
        top = want[k - 1].topk(3)
        names = [srv.gateway.tokenizer.decode([int(i)]) for i in top.indices]
        assert set(lp.top_logprobs[k]) >= set(names[:2]) or len(set(names)) < 3
    # the mean over the prompt is get_ppl's cross-entropy
    _, _, last = _generate(srv, None, GenerationConfig(max_new_tokens=1), input_ids=ids, prompt_loss=True)
    assert abs(-sum(got) / len(got) - last.prompt_loss) < 1e-4
    # the completion's part equals a plain request's
    plain = client.completions.create(model=MODEL, prompt=prompt, logprobs=3, max_tokens=4, temperature=0,
                                      extra_body={'ignore_eos': True})
    assert c.text == prompt + plain.choices[0].text
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_echo_scores_only_with_max_tokens_0_streamed_or_not(client, srv):
    rng = random.Random()
    prompts = [_sentence(rng), _sentence(rng)]
    r = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0)
    tok = srv.gateway.tokenizer
    assert r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    by_index = {c.index: c for c in r.choices}
    for i, p in enumerate(prompts):
        c = by_index[i]
        assert c.text == p and c.finish_reason == 'length'
        assert len(c.logprobs.tokens) == len(tok.encode(p))
        assert c.logprobs.token_logprobs[0] is None
        assert all(x <= 0 for x in c.logprobs.token_logprobs[1:])
    # streamed: the prompt comes first, with the same logprobs
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[0], echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True, extra_body={'ignore_eos': True}))
    whole = client.completions.create(model=MODEL, prompt=prompts[0], echo=True, logprobs=1, max_tokens=3,
                                      temperature=0, extra_body={'ignore_eos': True}).choices[0]
    assert chunks[0].choices[0].text == prompts[0]
    assert ''.join(ch.choices[0].text for ch in chunks if ch.choices) == whole.text
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and whole.logprobs.token_logprobs[0] is None
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-4)
    # echo without logprobs; a prompt of token ids echoes their text
    ids = tok.encode(prompts[1])
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=2, temperature=0)
    assert r.choices[0].text.startswith(tok.decode(ids)) and r.choices[0].logprobs is None
    assert_clean(srv)


# -------------------------------------------------------------- logit_bias
def test_logit_bias_forces_and_forbids(client, srv):
    rng = random.Random()
    prompt = 'What is the capital of France? The capital of France is'
    first = _generate(srv, prompt, GenerationConfig(max_new_tokens=1))[0][0]
    forced = rng.randrange(1000, 40000)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100})
    got = _generate(srv, prompt, GenerationConfig(max_new_tokens=3, logit_bias={forced: 100.0}))[0]
    assert got == [forced] * 3, (got, forced)
    assert r.choices[0].text == srv.gateway.tokenizer.decode(got)
    # the greedy token banned: another one comes first
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=0,
                                  logit_bias={str(first): -100})
    again = _generate(srv, prompt, GenerationConfig(max_new_tokens=1, logit_bias={first: -100.0}))[0]
    assert again[0] != first and r.choices[0].text == srv.gateway.tokenizer.decode(again)
    # sampled, too: a +100 bias wins every draw
    r = client.chat.completions.create(model=MODEL, messages=[{'role': 'user', 'content': 'Say something.'}],
                                       max_tokens=4, temperature=1.0, seed=rng.randrange(1 << 30),
                                       logit_bias={str(forced): 100})
    assert r.choices[0].message.content == srv.gateway.tokenizer.decode([forced] * 4)


def test_logit_bias_with_a_grammar(client, srv):
    """A grammar's mask still wins: a token banned by bias never comes, and the JSON still parses."""
    import json
    pytest.importorskip('xgrammar')
    tok = srv.gateway.tokenizer
    messages = [{'role': 'user', 'content': 'Give me a JSON object with a name and an age.'}]
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'p', 'schema': {
        'type': 'object', 'properties': {'name': {'type': 'string'}, 'age': {'type': 'integer'}},
        'required': ['name', 'age']}}}
    base = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                          response_format=fmt, logprobs=True)
    tokens = [tok.encode(t.token) for t in base.choices[0].logprobs.content]
    banned = next(ids[0] for ids in tokens[3:] if len(ids) == 1)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                       response_format=fmt, logprobs=True, logit_bias={str(banned): -100})
    json.loads(r.choices[0].message.content)
    assert banned not in [tok.encode(t.token)[0] for t in r.choices[0].logprobs.content]


def test_logit_bias_and_penalty_refusals(http, srv):
    vocab = srv.gateway.engine.model_config.vocab_size
    body = {'model': MODEL, 'prompt': 'Hi', 'max_tokens': 1}
    for bias, param in (({str(vocab): 5}, 'logit_bias'), ({'x': 5}, 'logit_bias'), ({'3': 101}, 'logit_bias'),
                        ({'03': 1}, 'logit_bias')):
        r = http.post('/v1/completions', json={**body, 'logit_bias': bias})
        assert r.status_code == 400, (bias, r.text)
        assert param in r.text
    for name in ('frequency_penalty', 'presence_penalty'):
        r = http.post('/v1/completions', json={**body, name: 2.5})
        assert r.status_code == 400 and name in r.text
    # the served schema bounds the keys by the vocabulary
    schema = http.get('/openapi.json').json()
    import re
    bias_schema = schema['components']['schemas']['CompletionRequest']['properties']['logit_bias']['anyOf'][0]
    pattern = re.compile(bias_schema['propertyNames']['pattern'])
    assert pattern.match(str(vocab - 1)) and not pattern.match(str(vocab))
    with pytest.raises(ValueError, match='logit_bias'):
        GenerationConfig(logit_bias={5: 100.5})
    with pytest.raises(ValueError, match='frequency_penalty'):
        GenerationConfig(frequency_penalty=math.nan)


# ------------------------------------------------------------------ penalties
def test_penalties_follow_openais_formula(srv):
    """Greedy with both penalties and a bias: each token is the argmax of the raw logits minus
    frequency * count - presence * [count > 0] over the tokens generated before it, plus the bias."""
    rng = random.Random()
    prompt = 'Repeat after me: la la la la la la la la la la la la'
    freq, pres = rng.uniform(0.3, 2.0), rng.uniform(-0.5, 2.0)
    bias = {rng.randrange(100, 40000): rng.uniform(-5, 5) for _ in range(3)}
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True, frequency_penalty=freq, presence_penalty=pres,
                           logit_bias=bias, output_logits='generation')
    ids, logits, _ = _generate(srv, prompt, gen)
    assert logits.shape[0] == len(ids) == 24
    counts = torch.zeros(logits.shape[1], dtype=torch.float64)
    for t, row in zip(ids, logits.double()):
        adjusted = row.clone()
        for k, b in bias.items():
            adjusted[k] += b
        adjusted -= counts * freq + (counts > 0).double() * pres
        top2 = adjusted.topk(2).values
        if float(top2[0] - top2[1]) > 1e-4:  # (no near-tie the float32 sampler could break differently)
            assert int(adjusted.argmax()) == t
        counts[t] += 1
    plain = _generate(srv, prompt, GenerationConfig(max_new_tokens=24, ignore_eos=True))[0]
    assert len(set(ids)) > len(set(plain)), (ids, plain)  # the penalty breaks the repetition


def test_penalties_through_the_api(client, srv):
    prompt = 'Repeat after me: la la la la la la la la la la la la'
    for name, value in (('frequency_penalty', 1.5), ('presence_penalty', 1.8), ('frequency_penalty', -1.0)):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={'ignore_eos': True}, **{name: value})
        ids = _generate(srv, prompt, GenerationConfig(max_new_tokens=16, ignore_eos=True, **{name: value}))[0]
        assert r.choices[0].text == srv.gateway.tokenizer.decode(ids)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={'ignore_eos': True})
    penalised = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                          frequency_penalty=2.0, extra_body={'ignore_eos': True})
    assert penalised.choices[0].text != plain.choices[0].text
    assert_clean(srv)


def test_prompt_logprobs_in_chunks_and_later_turns(smollm2_path, hf_model):
    """A prompt prefilled in several chunks gets one entry per token, each transformers' logprob; a later turn
    of an interactive session gets entries for its own prompt (its first token's is None)."""
    from lmdeploy import pipeline
    from lmdeploy.messages import PytorchEngineConfig
    rng = random.Random()
    pipe = pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='cpu', max_prefill_token_num=16,
                                                                     num_gpu_blocks=64, session_len=512))
    try:
        tok = pipe.gateway.tokenizer
        turn1 = tok.encode(' '.join(_sentence(rng) for _ in range(3)))  # several 16-token chunks
        turn2 = tok.encode(' ' + _sentence(rng))
        sid = pipe.gateway.next_session_id()

        async def turn(ids, start):
            outs = []
            async for out in pipe.gateway.generate(None, sid, GenerationConfig(max_new_tokens=2, prompt_logprobs=2),
                                                   input_ids=ids, interactive=True, sequence_start=start):
                outs.append(out)
            return outs
        first = asyncio.run(turn(turn1, True))
        second = asyncio.run(turn(turn2, False))
        lps1 = [e for o in first for e in (o.prompt_logprobs or [])]
        lps2 = [e for o in second for e in (o.prompt_logprobs or [])]
        assert sum(1 for o in first if o.prompt_logprobs) > 1  # streamed chunk by chunk
        assert len(lps1) == len(turn1) and lps1[0] is None
        assert len(lps2) == len(turn2) and lps2[0] is None
        history = turn1 + [t for o in first for t in o.token_ids] + turn2
        with torch.no_grad():
            want = hf_model(torch.tensor([history])).logits[0].float().log_softmax(-1)
        start2 = len(history) - len(turn2)
        for lps, ids, base in ((lps1, turn1, 0), (lps2, turn2, start2)):
            for k in range(1, len(ids)):
                entry = lps[k]
                assert len(entry) >= 2 and ids[k] in entry
                assert abs(entry[ids[k]] - float(want[base + k - 1, ids[k]])) < 2e-3
                assert int(want[base + k - 1].argmax()) in entry
        pipe.gateway.end_session(sid)
    finally:
        pipe.close()
