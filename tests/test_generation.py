"""Every GenerationConfig field, through the public pipeline (and the engine
where exact token control is needed), checked against independent references:
transformers' logits (``hf_logits``), its greedy ``generate`` (``hf_greedy``)
and its logits processors / warpers.

Most tests share one module-scoped pipeline on the tiny random 'llama' model
(greedy output of a prompt is a fixed, known sequence; the model never emits
EOS on its own, so EOS is forced with a logits processor where needed). The
SmolLM2 default model is used only where real text matters (a natural EOS,
a stop word in a real reply).

After every test that uses the shared pipeline, the engine must be idle,
its block accounting consistent and every KV block free.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import engine_utils
from engine_utils import submit
from helpers import _load_hf, hf_greedy, hf_logits

from lmdeploy import GenerationConfig, PytorchEngineConfig, RequestError, pipeline
from lmdeploy.engine.sequence import SamplingParams

EOS = 2  # the tiny models' eos (SmolLM2's <|im_end|>)
PROMPT = 'hello'
OTHER_PROMPT = 'tell me a story about a dragon'
ENGINE = dict(device_type='cpu', session_len=256, block_size=16, num_gpu_blocks=128)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope='module')
def tiny_path(tiny_model_factory):
    return tiny_model_factory('llama')


@pytest.fixture(scope='module')
def pipe(tiny_path):
    p = pipeline(tiny_path, backend_config=PytorchEngineConfig(**ENGINE))
    yield p
    p.close()


@pytest.fixture(scope='module')
def smol_pipe(smollm2_path):
    p = pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='cpu', session_len=512,
                                                                   num_gpu_blocks=16))
    yield p
    p.close()


def refused(pipe, prompts, *args, **kwargs):
    """What a refused call raises carries every result: the one (or, for a batch, all of them)."""
    with pytest.raises(RequestError) as e:
        pipe(prompts, *args, **kwargs)
    return e.value.responses[0] if isinstance(prompts, str) else e.value.responses


def assert_engine_clean(p):
    engine_utils.assert_engine_clean(p.engine)


@pytest.fixture(autouse=True)
def _engine_stays_clean(request):
    yield
    for name in ('pipe', 'smol_pipe'):
        if name in request.fixturenames:
            assert_engine_clean(request.getfixturevalue(name))


# --------------------------------------------------------------------------- references
def chat_ids(tokenizer, text):
    """Prompt ids as transformers' own chat template renders one user turn."""
    rendered = tokenizer.apply_chat_template([{'role': 'user', 'content': text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def ref_decode(path, ids, n, process=None, stop_ids=()):
    """Greedy loop on transformers' logits: ``process(ctx, generated, scores)``
    may edit the scores; a token in ``stop_ids`` ends it (not returned)."""
    ctx, gen = list(ids), []
    for _ in range(n):
        scores = hf_logits(path, ctx)[-1]
        if process is not None:
            scores = process(ctx, gen, scores.clone())
        tok = int(scores.argmax())
        if tok in stop_ids:
            return gen, 'stop'
        gen.append(tok)
        ctx.append(tok)
    return gen, 'length'


def step_logits(path, prompt_ids, generated):
    """transformers' logits [len(generated), V]: row i is the distribution token i was drawn from."""
    full = hf_logits(path, list(prompt_ids) + list(generated))
    p = len(prompt_ids)
    return full[p - 1:p - 1 + len(generated)]


def hf_last_hidden(path, ids):
    model = _load_hf(os.path.abspath(os.fspath(path)))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1][0], model


def force(token_at):
    """A logits processor forcing ``token_at(num_generated)`` (None: leave the scores)."""

    def proc(generated, scores):
        tok = token_at(len(generated))
        if tok is None:
            return scores
        forced = torch.full_like(scores, -1e9)
        forced[tok] = 0.0
        return forced

    return proc


def sample_cfg(**kw):
    base = dict(max_new_tokens=12, do_sample=True, top_k=0, temperature=1.0, ignore_eos=True)
    base.update(kw)
    return GenerationConfig(**base)


@pytest.fixture(scope='module')
def prompt_ids(pipe):
    return chat_ids(pipe.tokenizer, PROMPT)


@pytest.fixture(scope='module')
def greedy16(tiny_path, prompt_ids):
    """transformers' greedy continuation of PROMPT (16 tokens)."""
    return hf_greedy(tiny_path, [prompt_ids], 16)[0]


# --------------------------------------------------------------------------- length / eos
@pytest.mark.parametrize('n', [1, 7, 16])
def test_max_new_tokens_exact_length(pipe, prompt_ids, greedy16, n):
    r = pipe(PROMPT, GenerationConfig(max_new_tokens=n))
    assert r.input_token_len == len(prompt_ids)
    assert pipe.gateway.encode_prompt(PROMPT) == prompt_ids
    assert r.finish_reason == 'length'
    assert r.generate_token_len == len(r.token_ids) == n
    assert r.token_ids == greedy16[:n]
    assert r.text == pipe.tokenizer.decode(greedy16[:n], skip_special_tokens=True)


def test_eos_stops_unless_ignore_eos(pipe, greedy16):
    eos_at_3 = force(lambda k: EOS if k == 3 else None)
    r = pipe(PROMPT, GenerationConfig(max_new_tokens=8, logits_processors=[eos_at_3]))
    assert r.finish_reason == 'stop'
    assert r.token_ids == greedy16[:3] and r.generate_token_len == 3  # eos is not reported
    assert r.text == pipe.tokenizer.decode(greedy16[:3])

    r = pipe(PROMPT, GenerationConfig(max_new_tokens=8, ignore_eos=True, logits_processors=[eos_at_3]))
    assert r.finish_reason == 'length'
    assert r.generate_token_len == len(r.token_ids) == 8
    assert r.token_ids[:4] == greedy16[:3] + [EOS]
    assert '<|im_end|>' not in r.text  # skip_special_tokens defaults to True


def test_smollm2_natural_eos_vs_ignore_eos(smol_pipe, smollm2_path):
    ids = chat_ids(smol_pipe.tokenizer, 'Hi')
    r = smol_pipe('Hi', GenerationConfig(max_new_tokens=14, ignore_eos=True, skip_special_tokens=False))
    want = r.token_ids
    assert r.finish_reason == 'length' and len(want) == 14
    # greedy: each token is transformers' argmax for its context (one teacher-forced pass)
    assert step_logits(smollm2_path, ids, want).argmax(-1).tolist() == want
    assert EOS in want, 'SmolLM2 is expected to finish its reply to "Hi" early'
    assert '<|im_end|>' in r.text  # special tokens shown

    r = smol_pipe('Hi', GenerationConfig(max_new_tokens=40))
    assert r.input_token_len == len(ids)
    assert r.finish_reason == 'stop'
    assert r.token_ids == want[:want.index(EOS)]
    assert r.text.strip() and r.text == smol_pipe.tokenizer.decode(r.token_ids)

    r = smol_pipe('Hi', GenerationConfig(max_new_tokens=40, stop_words=['assist', 'help']))
    reply = smol_pipe.tokenizer.decode(want[:want.index(EOS)])
    cut = min(i for i in (reply.find('assist'), reply.find('help')) if i >= 0)
    assert r.finish_reason == 'stop' and r.text == reply[:cut]


def test_min_new_tokens_bans_stop_until_reached(pipe, tiny_path, prompt_ids, greedy16):
    k = 2
    stop = greedy16[k]
    assert stop not in greedy16[:k]
    r = pipe(PROMPT, GenerationConfig(max_new_tokens=16, stop_token_ids=[stop]))
    assert r.finish_reason == 'stop' and r.token_ids == greedy16[:k]

    m = 6

    def ban_until_m(ctx, gen, scores):
        if len(gen) < m:
            scores[stop] = float('-inf')
        return scores

    want, reason = ref_decode(tiny_path, prompt_ids, 16, ban_until_m, stop_ids={stop})
    r = pipe(PROMPT, GenerationConfig(max_new_tokens=16, stop_token_ids=[stop], min_new_tokens=m))
    assert r.token_ids == want and r.finish_reason == reason
    assert len(r.token_ids) >= m and stop not in r.token_ids
    assert r.token_ids[:k] == greedy16[:k] and r.token_ids != greedy16[:len(r.token_ids)]


def test_engine_min_new_tokens_with_eos(pipe, tiny_path):
    """Engine level: eos (forced by a processor) is banned before min_new_tokens."""
    ids = [1, 500, 600, 700, 800, 900]
    eos_first = force(lambda k: EOS if k < 5 else None)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=[EOS], min_new_tokens=3,
                            logits_processors=[eos_first])
    col = submit(pipe.engine, ids, params).wait()
    # steps 0..2: eos banned -> every score is -1e9 except eos (-inf): argmax is token 0
    assert col.token_ids == [0, 0, 0]
    assert col.final.finish_reason == 'stop'
    col = submit(pipe.engine, ids, SamplingParams(max_new_tokens=8, stop_token_ids=[EOS],
                                                  logits_processors=[eos_first])).wait()
    assert col.token_ids == [] and col.final.finish_reason == 'stop'


# --------------------------------------------------------------------------- greedy / sampling
def test_greedy_equivalence(pipe, greedy16):
    configs = [
        GenerationConfig(max_new_tokens=16),
        GenerationConfig(max_new_tokens=16, do_sample=True, top_k=1, temperature=1.5),
        GenerationConfig(max_new_tokens=16, do_sample=True, top_k=0, temperature=0.0),
        GenerationConfig(max_new_tokens=16, do_sample=True, top_k=1, random_seed=3, top_p=0.5),
    ]
    for r in pipe([PROMPT] * len(configs), configs):
        assert r.token_ids == greedy16


def test_random_seed_reproducible_regardless_of_batch(pipe):
    a = pipe(PROMPT, sample_cfg(random_seed=7))
    b = pipe(OTHER_PROMPT, sample_cfg(random_seed=11))
    assert pipe(PROMPT, sample_cfg(random_seed=7)).token_ids == a.token_ids
    batch1 = pipe([OTHER_PROMPT, PROMPT, PROMPT, 'x y z'],
                  [sample_cfg(random_seed=11), sample_cfg(random_seed=99), sample_cfg(random_seed=7),
                   sample_cfg(random_seed=5, top_k=5)])
    batch2 = pipe(['x y z', PROMPT, PROMPT, OTHER_PROMPT],
                  [GenerationConfig(max_new_tokens=3), sample_cfg(random_seed=7), sample_cfg(random_seed=1),
                   sample_cfg(random_seed=11)])
    assert batch1[2].token_ids == a.token_ids and batch1[2].text == a.text
    assert batch2[1].token_ids == a.token_ids
    assert batch1[0].token_ids == b.token_ids and batch2[3].token_ids == b.token_ids
    # different seeds: (almost surely) different samples
    texts = {r.text for r in pipe([PROMPT] * 6, [sample_cfg(random_seed=s, temperature=2.0) for s in range(6)])}
    assert len(texts) >= 5


def test_engine_seed_independent_of_batch(pipe):
    ids_a, ids_b = [1, 11, 12, 13, 14], [1, 40, 41]
    params = dict(max_new_tokens=10, greedy=False, temperature=2.5, top_k=0)
    alone = submit(pipe.engine, ids_a, SamplingParams(seed=123, **params)).wait().token_ids
    cols = [submit(pipe.engine, ids_b, SamplingParams(seed=5, **params)),
            submit(pipe.engine, ids_a, SamplingParams(seed=123, **params)),
            submit(pipe.engine, ids_a, SamplingParams(seed=124, **params))]
    got = [c.wait().token_ids for c in cols]
    assert got[1] == alone and got[2] != alone


def _allowed(logits, temperature, top_k, top_p, min_p):
    """The tokens transformers' warpers keep, applied in the engine's order."""
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    scores = (logits / temperature)[None].clone()
    dummy = torch.zeros((1, 1), dtype=torch.long)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(dummy, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(dummy, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(dummy, scores)
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


FILTERS = {
    'top_k': dict(top_k=3),
    'top_p': dict(top_k=0, top_p=0.6),
    'top_p_temp': dict(top_k=0, top_p=0.8, temperature=1.5),
    'min_p': dict(top_k=0, min_p=0.1),
    'combined': dict(top_k=5, top_p=0.9, min_p=0.05, temperature=1.3),
}


@pytest.mark.parametrize('filters', list(FILTERS.values()), ids=list(FILTERS))
def test_sampled_tokens_lie_in_allowed_set(pipe, tiny_path, prompt_ids, filters):
    cfg = {**dict(top_p=1.0, min_p=0.0, temperature=1.0), **filters}
    seeds = range(6)
    results = pipe([PROMPT] * len(seeds), [sample_cfg(random_seed=s, repetition_penalty=1.0, **cfg) for s in seeds])
    not_argmax = 0
    for r in results:
        assert len(r.token_ids) == 12
        for tok, row in zip(r.token_ids, step_logits(tiny_path, prompt_ids, r.token_ids)):
            allowed = _allowed(row, cfg['temperature'], cfg['top_k'], cfg['top_p'], cfg['min_p'])
            assert tok in allowed, (tok, sorted(allowed))
            not_argmax += tok != int(row.argmax())
    assert not_argmax > 0, 'sampling never left the argmax: the test proves nothing'


@pytest.mark.parametrize('penalty', [1.3, 0.7])
def test_repetition_penalty_matches_transformers(pipe, tiny_path, prompt_ids, greedy16, penalty):
    from transformers import RepetitionPenaltyLogitsProcessor
    proc = RepetitionPenaltyLogitsProcessor(penalty)

    def penalise(ctx, gen, scores):
        return proc(torch.tensor([ctx]), scores[None])[0]

    want, _ = ref_decode(tiny_path, prompt_ids, 16, penalise)
    r = pipe(PROMPT, GenerationConfig(max_new_tokens=16, repetition_penalty=penalty))
    assert r.token_ids == want
    assert want != greedy16  # the penalty changed something


# --------------------------------------------------------------------------- stop / bad
def test_stop_words(pipe, greedy16):
    tok = pipe.tokenizer
    text = tok.decode(greedy16)
    boundary = len(tok.decode(greedy16[:4]))
    # one stop word spans a token boundary, the other is a later whole token
    spanning = text[boundary - 2:boundary + 3]
    later = next(w for w in (tok.decode([t]).strip() for t in greedy16[5:]) if text.find(w) > boundary + 3)
    assert text.find(spanning) == boundary - 2
    for include in (False, True):
        gen = GenerationConfig(max_new_tokens=16, stop_words=[later, spanning], include_stop_str_in_output=include)
        r = pipe(PROMPT, gen)
        start = text.find(spanning)
        assert r.finish_reason == 'stop'
        assert r.text == text[:start + (len(spanning) if include else 0)]
        # the ids include the token that completed the stop word, and only what was reported
        assert r.generate_token_len == len(r.token_ids) == 5
        assert r.token_ids == greedy16[:5]
        # streamed deltas (which cannot be taken back) add up to the same text: no part of the
        # stop word was shown before it was known to be one
        parts = [d.text for d in pipe.stream_infer(PROMPT, gen)]
        assert ''.join(parts) == r.text


def test_stop_word_reports_logprobs_and_logits_of_kept_tokens(pipe, greedy16):
    word = pipe.tokenizer.decode(greedy16[4:5]).strip()
    r = pipe(PROMPT, GenerationConfig(max_new_tokens=16, stop_words=[word], logprobs=1, output_logits='generation'))
    n = r.generate_token_len
    assert r.finish_reason == 'stop' and word not in r.text
    assert len(r.token_ids) == len(r.logprobs) == r.logits.shape[0] == n
    assert r.token_ids == greedy16[:n]


def test_stop_token_ids(pipe, greedy16):
    k = greedy16.index(greedy16[5])
    r = pipe(PROMPT, GenerationConfig(max_new_tokens=16, stop_token_ids=[greedy16[5], 47000]))
    assert r.finish_reason == 'stop' and r.token_ids == greedy16[:k]
    r = refused(pipe, PROMPT, GenerationConfig(max_new_tokens=4, stop_token_ids=[10**6]))
    assert r.finish_reason == 'error' and 'stop_token_ids' in r.error


def _bigram_word(tok, ids):
    """A 2-token word (from adjacent ids) that the tokenizer encodes back to the same ids."""
    for a, b in zip(ids, ids[1:]):
        word = tok.decode([a, b])
        if tok.encode(word, add_special_tokens=False) == [a, b]:
            return word, (a, b)
    pytest.skip('no adjacent pair round-trips through the tokenizer')


def test_bad_words_and_bad_token_ids(pipe, tiny_path, prompt_ids, greedy16):
    tok = pipe.tokenizer
    single = tok.decode(greedy16[4:5])
    assert tok.encode(single, add_special_tokens=False) == [greedy16[4]]
    banned = {greedy16[0], greedy16[4]}

    def ban(ctx, gen, scores):
        scores[list(banned)] = float('-inf')
        return scores

    want, _ = ref_decode(tiny_path, prompt_ids, 12, ban)
    r = pipe(PROMPT, GenerationConfig(max_new_tokens=12, bad_token_ids=[greedy16[0]], bad_words=[single]))
    assert r.token_ids == want and not banned & set(r.token_ids)

    # a multi-token bad word: its last token is banned right after its prefix
    word, (a, b) = _bigram_word(tok, greedy16)

    def ban_pair(ctx, gen, scores):
        if ctx[-1] == a:
            scores[b] = float('-inf')
        return scores

    want, _ = ref_decode(tiny_path, prompt_ids, 12, ban_pair)
    r = pipe(PROMPT, GenerationConfig(max_new_tokens=12, bad_words=[word]))
    assert r.token_ids == want
    pairs = list(zip(prompt_ids[-1:] + r.token_ids, r.token_ids))
    assert (a, b) not in pairs
    assert word not in r.text

    r = refused(pipe, PROMPT, GenerationConfig(max_new_tokens=4, bad_token_ids=[10**6]))
    assert r.finish_reason == 'error' and 'bad_token_ids' in r.error


# --------------------------------------------------------------------------- logprobs / logits / hidden
def test_logprobs_match_transformers(pipe, tiny_path, prompt_ids, greedy16):
    r = pipe(PROMPT, GenerationConfig(max_new_tokens=8, logprobs=3))
    assert r.token_ids == greedy16[:8] and len(r.logprobs) == 8
    ref = step_logits(tiny_path, prompt_ids, r.token_ids).log_softmax(-1)
    for tok, entry, row in zip(r.token_ids, r.logprobs, ref):
        assert tok in entry and len(entry) == 3  # greedy: the chosen token is the top one
        assert set(entry) == set(row.topk(3).indices.tolist())
        for tid, lp in entry.items():
            assert abs(lp - float(row[tid])) < 1e-4

    # sampled, N=2: the chosen token is added when it is outside the top 2 (N+1 entries)
    results = pipe([PROMPT] * 3, [sample_cfg(random_seed=s, logprobs=2, temperature=2.0) for s in range(3)])
    sizes = set()
    for r in results:
        ref = step_logits(tiny_path, prompt_ids, r.token_ids).log_softmax(-1)
        assert len(r.logprobs) == len(r.token_ids)
        for tok, entry, row in zip(r.token_ids, r.logprobs, ref):
            top2 = set(row.topk(2).indices.tolist())
            assert tok in entry and top2 <= set(entry)
            assert len(entry) == (2 if tok in top2 else 3)
            sizes.add(len(entry))
            for tid, lp in entry.items():
                assert abs(lp - float(row[tid])) < 1e-4
    assert sizes == {2, 3}

    r = pipe(PROMPT, GenerationConfig(max_new_tokens=3, logprobs=0))
    assert [list(e) for e in r.logprobs] == [[t] for t in r.token_ids]


def test_output_logits(pipe, tiny_path, prompt_ids, greedy16):
    n, p = 6, len(prompt_ids)
    gen = pipe(PROMPT, GenerationConfig(max_new_tokens=n, output_logits='generation'))
    assert gen.token_ids == greedy16[:n]
    assert tuple(gen.logits.shape) == (n, 49152)
    torch.testing.assert_close(gen.logits, step_logits(tiny_path, prompt_ids, gen.token_ids), atol=1e-4, rtol=0)

    every = pipe(PROMPT, GenerationConfig(max_new_tokens=n, output_logits='all'))
    # every position the model ran: the prompt and all generated tokens but the last
    assert tuple(every.logits.shape) == (p + n - 1, 49152)
    torch.testing.assert_close(every.logits, hf_logits(tiny_path, prompt_ids + every.token_ids[:-1]), atol=1e-4,
                               rtol=0)
    # the same rows from two runs: a logits GEMM over p + n - 1 rows or one row sums in another order on the
    # cpu (CI saw 1.4e-5 apart, on logits of ~10), so to the tolerance both meet against transformers
    torch.testing.assert_close(every.logits[p - 1:], gen.logits, atol=1e-4, rtol=0)

    # stopped by a stop token: no row for the (unreported) stop token
    eos_at_3 = force(lambda k: EOS if k == 3 else None)
    for mode, rows in (('generation', 3), ('all', p + 2)):
        r = pipe(PROMPT, GenerationConfig(max_new_tokens=n, output_logits=mode, logits_processors=[eos_at_3]))
        assert r.finish_reason == 'stop' and len(r.token_ids) == 3
        assert r.logits.shape[0] == rows, mode


def test_output_last_hidden_state(pipe, tiny_path, prompt_ids, greedy16):
    n, p = 5, len(prompt_ids)
    gen = pipe(PROMPT, GenerationConfig(max_new_tokens=n, output_last_hidden_state='generation'))
    every = pipe(PROMPT, GenerationConfig(max_new_tokens=n, output_last_hidden_state='all', output_logits='all'))
    hidden_size = 64
    assert gen.token_ids == every.token_ids == greedy16[:n]
    assert tuple(gen.last_hidden_state.shape) == (n, hidden_size)
    assert tuple(every.last_hidden_state.shape) == (p + n - 1, hidden_size)
    # transformers' last hidden_states entry has the final norm applied (it is what lm_head sees)
    want, model = hf_last_hidden(tiny_path, prompt_ids + every.token_ids[:-1])
    torch.testing.assert_close(every.last_hidden_state, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(gen.last_hidden_state, every.last_hidden_state[p - 1:], atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(every.last_hidden_state), every.logits, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- processors / special tokens
def test_logits_processors(pipe, prompt_ids):
    seen = []

    def always_1234(generated, scores):
        seen.append(generated.tolist())
        scores = torch.full_like(scores, float('-inf'))
        scores[1234] = 0.0
        return scores

    r = pipe(PROMPT, GenerationConfig(max_new_tokens=6, logits_processors=[always_1234]))
    assert r.token_ids == [1234] * 6
    assert r.text == pipe.tokenizer.decode([1234] * 6)
    assert seen == [[1234] * i for i in range(6)]  # called once a step with the ids generated so far

    def boom(generated, scores):
        raise RuntimeError('processor exploded')

    r = refused(pipe, PROMPT, GenerationConfig(max_new_tokens=4, logits_processors=[boom]))
    assert r.finish_reason == 'error' and 'processor exploded' in r.error


@pytest.mark.parametrize('spaces', [True, False])
def test_skip_special_tokens(pipe, spaces):
    special = 0  # <|endoftext|>: special, but not a stop token
    assert pipe.tokenizer.convert_ids_to_tokens(special) == '<|endoftext|>'
    proc = force(lambda k: special if k % 2 == 0 else 1234)
    word = pipe.tokenizer.decode([1234])
    shown = pipe(PROMPT, GenerationConfig(max_new_tokens=4, logits_processors=[proc], skip_special_tokens=False,
                                          spaces_between_special_tokens=spaces))
    hidden = pipe(PROMPT, GenerationConfig(max_new_tokens=4, logits_processors=[proc],
                                           spaces_between_special_tokens=spaces))
    assert shown.token_ids == hidden.token_ids == [special, 1234, special, 1234]
    assert hidden.text == word * 2
    assert shown.text.count('<|endoftext|>') == 2 and shown.text.replace('<|endoftext|>', '').strip() == \
        (word * 2).strip()


# --------------------------------------------------------------------------- invalid values
INVALID = [
    ('top_p', 0.0),
    ('top_p', 1.5),
    ('temperature', -1.0),
    ('max_new_tokens', -1),
    ('max_new_tokens', True),
    ('frequency_penalty', 2.5),
    ('presence_penalty', -3.0),
    ('presence_penalty', float('nan')),
    ('logit_bias', {-1: 1.0}),
    ('logit_bias', {5: 100.5}),
    ('logit_bias', {5: float('inf')}),
    ('prompt_logprobs', -1),
    ('top_k', -1),
    ('min_p', 2.0),
    ('n', 0),
    ('n', 65),
    ('logprobs', -1),
    ('repetition_penalty', 0.0),
    ('repetition_penalty', float('nan')),
    ('repetition_penalty', float('inf')),
    ('temperature', float('nan')),
    ('temperature', float('inf')),
    ('random_seed', -3),
    ('min_new_tokens', -1),
    ('output_logits', 'everything'),
    ('stop_words', ['']),
]


@pytest.mark.parametrize('field,value', INVALID, ids=[f'{f}={v!r}' for f, v in INVALID])
def test_invalid_values_raise(field, value):
    with pytest.raises(ValueError, match=rf'GenerationConfig\.{field}\b'):
        GenerationConfig(**{field: value})


def test_invalid_values_through_pipeline(pipe, greedy16):
    for field, value in INVALID:
        gen = GenerationConfig(max_new_tokens=4)
        setattr(gen, field, value)  # skip __post_init__: the gateway validates again
        with pytest.raises(ValueError, match=rf'GenerationConfig\.{field}\b'):
            pipe.gateway.sampling_params(gen)
        r = refused(pipe, PROMPT, gen)
        assert r.finish_reason == 'error' and f'GenerationConfig.{field} ' in r.error, (field, r.error)
        assert r.generate_token_len == 0 and r.token_ids == [] and r.text == ''
    assert pipe(PROMPT, GenerationConfig(max_new_tokens=4)).token_ids == greedy16[:4]


def test_values_float32_cannot_honour(pipe, greedy16):
    """A temperature that is 0 in float32 (1e-46, 5e-324) decodes greedily instead of dividing the logits
    by zero (NaN logits, then token 0 every step); a repetition penalty too small for float32 logits is
    applied as the smallest one they hold (the same order of tokens), not as a division by zero."""
    for temperature in (1e-300, 1e-46, 5e-324):
        r = pipe(PROMPT, GenerationConfig(max_new_tokens=16, do_sample=True, temperature=temperature, random_seed=1))
        assert r.token_ids == greedy16, temperature
    tiny = pipe(PROMPT, GenerationConfig(max_new_tokens=8, repetition_penalty=1e-46))
    bound = pipe(PROMPT, GenerationConfig(max_new_tokens=8, repetition_penalty=1e-6))
    assert tiny.finish_reason == 'length' and tiny.token_ids == bound.token_ids


def test_nan_logits_are_an_engine_fault(pipe, greedy16):
    """Logits with nothing finite to draw from fail the request as the engine's fault, naming it (they
    used to become token 0, or a grammar's complaint about the request)."""
    def nan(generated, scores):
        return scores * float('nan')

    for gen in (GenerationConfig(max_new_tokens=4, logits_processors=[nan]),
                GenerationConfig(max_new_tokens=4, do_sample=True, temperature=1.0, logits_processors=[nan])):
        r = refused(pipe, PROMPT, gen)
        assert r.finish_reason == 'error' and 'engine fault' in r.error and 'finite' in r.error, r.error
        assert r.token_ids == []
    assert pipe(PROMPT, GenerationConfig(max_new_tokens=4)).token_ids == greedy16[:4]


# --------------------------------------------------------------------------- bad inputs
def test_empty_prompt(pipe, greedy16):
    r = refused(pipe, '', GenerationConfig(max_new_tokens=4), do_preprocess=False)
    assert r.finish_reason == 'error' and 'empty' in r.error
    assert r.generate_token_len == 0 and r.token_ids == []
    assert_engine_clean(pipe)
    # in a batch, only the empty one fails
    ok, bad = refused(pipe, [PROMPT, ''], GenerationConfig(max_new_tokens=4), do_preprocess=False)
    assert bad.finish_reason == 'error' and ok.finish_reason == 'length' and len(ok.token_ids) == 4
    # with the chat template an empty message is still a (non-empty) prompt
    r = pipe('', GenerationConfig(max_new_tokens=4))
    assert r.finish_reason == 'length' and r.input_token_len == len(chat_ids(pipe.tokenizer, ''))
    with pytest.raises(ValueError, match='no prompts'):
        pipe([])
    assert pipe(PROMPT, GenerationConfig(max_new_tokens=4)).token_ids == greedy16[:4]


def test_over_long_prompt(pipe, greedy16):
    session_len = pipe.engine.session_len
    r = refused(pipe, 'x ' * (session_len + 20), GenerationConfig(max_new_tokens=4))
    # refused, so reported as an error (the engine's 'length' is for an answer cut short)
    assert r.finish_reason == 'error' and r.generate_token_len == 0 and r.token_ids == []
    assert r.input_token_len > session_len
    assert r.error and 'session_len' in r.error
    assert_engine_clean(pipe)
    # a prompt that fits, with output that would not: generation stops at session_len
    r = pipe('x ' * (session_len - 20), GenerationConfig(max_new_tokens=64))
    assert r.error is None and r.finish_reason == 'length'
    assert r.input_token_len < session_len and r.input_token_len + r.generate_token_len == session_len
    assert pipe(PROMPT, GenerationConfig(max_new_tokens=4)).token_ids == greedy16[:4]


def test_missing_model_path(tmp_path):
    missing = str(tmp_path / 'no-such-model')
    with pytest.raises(FileNotFoundError, match='no-such-model'):
        pipeline(missing, backend_config=PytorchEngineConfig(device_type='cpu'))
    empty = tmp_path / 'empty-dir'
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match='config.json'):
        pipeline(str(empty), backend_config=PytorchEngineConfig(device_type='cpu'))


def test_unknown_architecture(tmp_path, tiny_path, pipe, greedy16):
    bad = tmp_path / 'foo-model'
    shutil.copytree(tiny_path, bad)
    cfg_path = bad / 'config.json'
    cfg = json.loads(cfg_path.read_text())
    cfg['architectures'] = ['FooForCausalLM']
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match='FooForCausalLM') as info:
        pipeline(str(bad), backend_config=PytorchEngineConfig(device_type='cpu', num_gpu_blocks=4))
    assert 'LlamaForCausalLM' in str(info.value) and 'supported' in str(info.value)
    # the shared pipeline is unaffected
    assert pipe(PROMPT, GenerationConfig(max_new_tokens=4)).token_ids == greedy16[:4]


# --------------------------------------------------------------------------- cancellation
def test_cancel_by_leaving_stream(pipe, greedy16):
    before = pipe.engine.stats().num_generated_tokens
    got = []
    for r in pipe.stream_infer(PROMPT, GenerationConfig(max_new_tokens=200)):
        got.extend(r.token_ids)
        if len(got) >= 3:
            break  # the generator is dropped (and closed) here
    assert got == greedy16[:len(got)]
    assert_engine_clean(pipe)
    assert pipe.engine.stats().num_generated_tokens - before < 200

    # a batch, closed explicitly
    before = pipe.engine.stats().num_generated_tokens
    stream = pipe.stream_infer([PROMPT, OTHER_PROMPT], GenerationConfig(max_new_tokens=200))
    next(stream)
    next(stream)
    stream.close()
    assert_engine_clean(pipe)
    assert pipe.engine.stats().num_generated_tokens - before < 400
    assert pipe(PROMPT, GenerationConfig(max_new_tokens=6)).token_ids == greedy16[:6]


# --------------------------------------------------------------------------- interactive chat
def test_chat_keeps_history_in_cache(pipe, tiny_path, prompt_ids):
    runner = pipe.engine.runner
    fed = []
    orig = runner.forward

    def spy(batch, prev_tokens=None):
        fed.append(sum(batch.num_new_tokens))
        return orig(batch, prev_tokens)

    runner.forward = spy
    try:
        gen = GenerationConfig(max_new_tokens=5)
        sess = pipe.chat(PROMPT, gen_config=gen)
        r1 = sess.response
        assert r1.input_token_len == len(prompt_ids) and r1.finish_reason == 'length'
        # prefill the prompt, then one token a step; the last token is never fed
        assert sum(fed) == len(prompt_ids) + r1.generate_token_len - 1
        assert pipe.engine.wait_idle()
        stats = pipe.engine.stats()
        assert stats.num_idle_sessions == 1 and stats.num_free_blocks < stats.num_blocks
        pipe.engine.check_invariants()

        fed.clear()
        deltas = list(pipe.chat('and then?', session=sess, gen_config=gen, stream_response=True))
        r2 = sess.response
        assert sess.step == 2 and ''.join(d.text for d in deltas) == r2.text
        history = r1.input_token_len + r1.generate_token_len
        new_ids = pipe.gateway.encode_prompt([{'role': 'user', 'content': 'and then?'}], sequence_start=False)
        # the second turn's input counts the history...
        assert r2.input_token_len == history + len(new_ids)
        # ...but only the new turn (plus the uncomputed last reply token) is prefilled
        assert fed[0] == len(new_ids) + 1
        assert sum(fed) == len(new_ids) + r2.generate_token_len
        # and the kept cache gives what a fresh run on the whole conversation gives
        full = prompt_ids + r1.token_ids + new_ids
        assert r2.token_ids == hf_greedy(tiny_path, [full], r2.generate_token_len)[0]
    finally:
        del runner.forward
    pipe.end_session(sess)
    assert pipe.engine.wait_idle()
    stats = pipe.engine.stats()
    assert stats.num_idle_sessions == 0 and stats.num_free_blocks == stats.num_blocks


def test_unknown_pipeline_arguments_are_refused(pipe):
    with pytest.raises(TypeError, match='adapter'):
        pipe('Hi', GenerationConfig(max_new_tokens=2), adapter_name='lora1')
    # a None value changes nothing and passes (LMDeploy callers send adapter_name=None)
    assert pipe('Hi', GenerationConfig(max_new_tokens=2), adapter_name=None).generate_token_len == 2
