"""The public pipeline on the embedded default model (SmolLM2-135M-Instruct)."""
import re

import pytest
from engine_utils import assert_engine_clean
from helpers import hf_loss

from lmdeploy import GenerationConfig, PytorchEngineConfig, RequestError, Response, pipeline


@pytest.fixture(scope='module')
def pipe(smollm2_path):
    p = pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='cpu', session_len=2048))
    yield p
    p.close()


def test_answers_paris_through_chat_template(pipe):
    resp = pipe('What is the capital of France?', GenerationConfig(max_new_tokens=24))
    assert isinstance(resp, Response)
    assert 'Paris' in resp.text
    assert resp.finish_reason == 'stop'
    assert resp.generate_token_len == len(resp.token_ids) > 0
    assert resp.input_token_len > 5


def test_messages_and_batches_keep_input_order(pipe):
    gen = GenerationConfig(max_new_tokens=12)
    prompts = ['Shanghai is', [{'role': 'user', 'content': 'What is the capital of France?'}], 'Hi']
    batch = pipe(prompts, gen)
    assert [r.index for r in batch] == [0, 1, 2]
    singles = [pipe(p, gen) for p in prompts]
    assert [r.text for r in batch] == [r.text for r in singles]
    assert 'Paris' in batch[1].text


def test_batch_reaches_engine_longest_first_and_returns_in_input_order(pipe):
    """A batch is submitted longest max_new_tokens first (sessions are
    numbered as they are submitted), ties in input order; every response
    still lands at its prompt's index, each as if run alone."""
    lengths = [3, 9, 5, 9]
    gens = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in lengths]
    prompts = ['Shanghai is', 'Count from one to ten:', 'Hi', 'The sky is']
    batch = pipe(prompts, gens)
    assert [r.index for r in batch] == [0, 1, 2, 3]
    assert [r.generate_token_len for r in batch] == lengths
    submitted = sorted(range(4), key=lambda i: batch[i].session_id)
    assert submitted == [1, 3, 2, 0]
    assert [r.text for r in batch] == [pipe(p, g).text for p, g in zip(prompts, gens)]


def test_invalid_limit_in_a_batch_fails_only_its_request(pipe):
    bad = GenerationConfig(max_new_tokens=4)
    bad.max_new_tokens = None  # edited after validation: the batch order must not trip over it
    with pytest.raises(RequestError, match=r'^prompt 1 of 2: .*max_new_tokens') as e:
        pipe(['Hi', 'Hello'], [GenerationConfig(max_new_tokens=3, ignore_eos=True), bad])
    good, failed = e.value.responses
    assert e.value.index == 1 and good.generate_token_len == 3 and 'max_new_tokens' in repr(failed)
    assert failed.finish_reason == 'error' and 'max_new_tokens' in failed.error


def test_stream_pieces_join_to_infer_text(pipe):
    gen = GenerationConfig(max_new_tokens=40)
    prompts = ['Say hello in Chinese and add an emoji.', 'Count from one to five.']
    full = pipe(prompts, gen)
    pieces = {0: [], 1: []}
    finals = {}
    for r in pipe.stream_infer(prompts, gen):
        pieces[r.index].append(r.text)
        if r.finish_reason:
            finals[r.index] = r
    for i in (0, 1):
        assert ''.join(pieces[i]) == full[i].text
        assert finals[i].generate_token_len == full[i].generate_token_len


def test_get_ppl_matches_transformers_loss(pipe, smollm2_path):
    tok = pipe.tokenizer
    seqs = [tok.encode('The capital of France is Paris, a city on the Seine.'),
            tok.encode('def add(a, b):\n    return a + b\n')]
    got = pipe.get_ppl(seqs)
    for ids, loss in zip(seqs, got):
        want = hf_loss(smollm2_path, ids)
        assert loss == pytest.approx(want, rel=1e-4)


def test_get_ppl_with_chunked_prefill(smollm2_path):
    ids = list(range(1000, 1150))
    with pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='cpu', max_prefill_token_num=32,
                                                                   block_size=16)) as p:
        got = p.get_ppl(ids)[0]
        assert p.engine.wait_idle()
        p.engine.check_invariants()
    assert got == pytest.approx(hf_loss(smollm2_path, ids), rel=1e-4)


def test_chat_keeps_session_and_refers_back(pipe):
    sess = pipe.chat('My name is Alice. Please remember my name.', gen_config=GenerationConfig(max_new_tokens=30))
    first_len = sess.response.input_token_len + sess.response.generate_token_len
    sess = pipe.chat('What did I say my name was?', session=sess, gen_config=GenerationConfig(max_new_tokens=30))
    assert sess.step == 2
    # the second turn's context includes the whole first exchange
    assert sess.response.input_token_len > first_len
    pipe.end_session(sess)
    assert pipe.engine.wait_idle()
    pipe.engine.check_invariants()


def test_default_model_alias_resolves(smollm2_path):
    from lmdeploy.default_model import resolve_model_path
    assert resolve_model_path(None) == smollm2_path


def test_refused_requests_raise_and_say_why(pipe):
    """No silent failures: each way a request can be refused raises RequestError with a reason in words
    (a lone surrogate is named as such, not by the tokenizer's internals); stream_infer ends with a
    Response whose repr shows the error; the engine is left clean."""
    cases = [(('x ' * (pipe.engine.session_len + 5), ), {}, 'session_len'),
             (('', ), dict(do_preprocess=False), 'empty'),
             (('caf\ud800', ), {}, 'lone surrogate (U+D800)'),
             (([{'role': 'user', 'content': 'a\udfffb'}], ), {}, "message 0's content"),
             (('Hi', GenerationConfig(stop_words=['\ud800'])), {}, 'stop_words'),
             (('Hi', GenerationConfig(response_format={'type': 'yaml'})), {}, 'is not one of'),
             (('Hi', GenerationConfig(response_format={'type': 'regex', 'regex': '(a'})), {},
              'the regular expression cannot be used')]
    for args, kwargs, reason in cases:
        with pytest.raises(RequestError, match=re.escape(reason)) as e:
            pipe(*args, **kwargs)
        assert 'TextEncodeInput' not in str(e.value) and e.value.responses[0].refused
        last = list(pipe.stream_infer(*args, **kwargs))[-1]
        assert last.finish_reason == 'error' and last.refused and reason in repr(last)
    with pytest.raises(RequestError, match='lone surrogate'):
        pipe.chat('\ud83d')
    assert pipe('Hi', GenerationConfig(max_new_tokens=2, ignore_eos=True)).generate_token_len == 2
    assert_engine_clean(pipe.engine)


def test_structured_output_in_python(pipe):
    """GenerationConfig(response_format=...): a JSON schema's answers validate, greedy and sampled; in a
    batch with unconstrained prompts each answer is what it is alone."""
    jsonschema = pytest.importorskip('jsonschema')
    pytest.importorskip('xgrammar')
    import json
    schema = {'type': 'object', 'properties': {'city': {'type': 'string', 'maxLength': 20},
                                               'population': {'type': 'integer', 'minimum': 0, 'maximum': 99999999}},
              'required': ['city', 'population']}
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'c', 'schema': schema}}
    q = 'What is the capital of France? Answer in JSON.'
    gens = [GenerationConfig(max_new_tokens=60, response_format=fmt)] + [
        GenerationConfig(max_new_tokens=60, response_format=fmt, do_sample=True, temperature=1.0, random_seed=s)
        for s in range(4)]
    for r in pipe([q] * 5, gens):
        assert r.finish_reason == 'stop', r.text
        jsonschema.validate(json.loads(r.text), schema)
    plain = GenerationConfig(max_new_tokens=12)
    mixed = pipe([q, 'Shanghai is', q], [gens[0], plain, plain])
    assert [r.text for r in mixed] == [pipe(q, gens[0]).text, pipe('Shanghai is', plain).text, pipe(q, plain).text]


def test_n_samples_per_prompt(pipe, smollm2_path):
    """GenerationConfig(n=k): a prompt's result is a list of k Responses (choice 0..k-1), sample i what a
    single request seeded with seed + i gives; in a batch, prompts with n=1 keep their plain Response;
    stream_infer's pieces carry the choice and join into infer's texts; chat() refuses n > 1."""
    sampled = dict(max_new_tokens=8, do_sample=True, temperature=1.0, top_k=0, random_seed=21)
    rs = pipe('Name a fruit.', GenerationConfig(n=3, **sampled))
    assert isinstance(rs, list) and [(r.index, r.choice) for r in rs] == [(0, 0), (0, 1), (0, 2)]
    singles = [pipe('Name a fruit.', GenerationConfig(**dict(sampled, random_seed=21 + i))).text for i in range(3)]
    assert [r.text for r in rs] == singles
    assert len({r.session_id for r in rs}) == 3
    batch = pipe(['Name a fruit.', 'Name a color.'],
                 [GenerationConfig(n=2, **sampled), GenerationConfig(max_new_tokens=4)])
    assert [r.text for r in batch[0]] == singles[:2] and isinstance(batch[1], Response)
    joined = {}
    for piece in pipe.stream_infer('Name a fruit.', GenerationConfig(n=3, **sampled)):
        joined[piece.choice] = joined.get(piece.choice, '') + piece.text
    assert [joined[i] for i in range(3)] == singles
    with pytest.raises(ValueError, match='n must be 1'):
        pipe.chat('Hi', gen_config=GenerationConfig(n=2))
    for bad in (0, 65, 1.5):
        with pytest.raises(ValueError, match='GenerationConfig.n'):
            GenerationConfig(n=bad)
    assert_engine_clean(pipe.engine)


@pytest.mark.parametrize('prefix_caching', [True, False])
def test_n_samples_share_the_prompts_prefill(smollm2_path, prefix_caching):
    """A prompt's later samples start once its first has output (not once it has finished) and take its
    full prompt blocks, prefix caching on or off: the prompt is prefilled about once, and the samples run
    side by side."""
    p = pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='cpu', session_len=1024,
                                                                  block_size=16, enable_prefix_caching=prefix_caching))
    try:
        prompt = 'Tell me about the history of the city of Paris, its rivers and its bridges. ' * 3
        import threading
        import time
        running, stop = [0], threading.Event()

        def watch():  # the most samples in the engine at once
            while not stop.is_set():
                stats = p.engine.stats()
                running[0] = max(running[0], stats.num_running + stats.num_waiting)
                time.sleep(0.002)
        watcher = threading.Thread(target=watch)
        watcher.start()
        before = p.engine.stats().num_prefix_hit_tokens
        try:
            rs = p(prompt, GenerationConfig(n=4, max_new_tokens=32, ignore_eos=True, do_sample=True, random_seed=3))
        finally:
            stop.set()
            watcher.join()
        hit = p.engine.stats().num_prefix_hit_tokens - before
        full_blocks = rs[0].input_token_len // 16 * 16
        assert len(rs) == 4 and hit >= 3 * (full_blocks - 16), (hit, rs[0].input_token_len)
        assert running[0] == 4  # side by side, not one after another
        assert len({r.text for r in rs}) > 1  # seeds differ per sample
        before = p.engine.stats().num_prefix_hit_tokens
        p(prompt, GenerationConfig(max_new_tokens=2))
        # a lone request reuses the blocks only where prefix caching is on
        assert (p.engine.stats().num_prefix_hit_tokens > before) == prefix_caching
        stats = p.engine.stats()
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        p.close()


def test_get_ppl_checks_the_whole_batch_before_running_any(pipe):
    """A bad sequence anywhere in the batch raises before anything reaches the engine (a sequence that ran
    while the call raised once left the process to abort at exit)."""
    tok = pipe.tokenizer
    valid = tok.encode('The capital of France is Paris, a city on the Seine. ' * 20)
    vocab = pipe.engine.model_config.vocab_size
    before = pipe.engine.stats().extra['prefill_tokens']
    for bad, why in [([7], r'input_ids\[1\] has 1 token'), ([], r'input_ids\[1\] has 0 token'),
                     ([1, vocab], rf'token id {vocab}, outside the vocabulary'), ([1, -1], 'token id -1'),
                     (list(range(5, 5 + pipe.engine.session_len)), 'session_len')]:
        with pytest.raises(ValueError, match=why):
            pipe.get_ppl([valid, bad])
    with pytest.raises(TypeError, match='list of token ids'):
        pipe.get_ppl([valid, 'text'])
    assert pipe.engine.wait_idle()
    assert pipe.engine.stats().extra['prefill_tokens'] == before  # nothing ran
    assert pipe.get_ppl([valid[:20], valid[:30]])[1] > 0  # and the pipeline goes on


def test_a_failed_batch_cancels_the_rest():
    """When one request of a call raises, the others are cancelled and waited for before the call raises."""
    import asyncio

    from lmdeploy.frontend.pipeline import _gather_or_cancel
    ended = []

    async def slow(i):
        try:
            await asyncio.sleep(30)
        finally:
            ended.append(i)

    async def bad():
        await asyncio.sleep(0.01)
        raise ValueError('bad input')

    async def main():
        with pytest.raises(ValueError, match='bad input'):
            await _gather_or_cancel([slow(0), bad(), slow(1)])
        return sorted(ended)

    assert asyncio.run(asyncio.wait_for(main(), 5)) == [0, 1]


def test_a_closed_pipeline_refuses_every_call_at_once(tiny_model_factory):
    """close() ends a call running on another thread (no caller waits forever), and any later call raises
    a clear error at once instead of blocking."""
    import threading
    import time
    p = pipeline(tiny_model_factory('llama'), backend_config=PytorchEngineConfig(
        device_type='cpu', session_len=256, num_gpu_blocks=32, block_size=16))
    first, outcome = threading.Event(), {}

    def stream():
        try:
            for piece in p.stream_infer([5, 6, 7], GenerationConfig(max_new_tokens=240, ignore_eos=True)):
                first.set()
                outcome['last'] = piece
        except Exception as e:
            outcome['error'] = e
        first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    p.close()
    t.join(10)
    assert not t.is_alive(), 'a call that ran during close() never returned'
    assert 'error' in outcome or outcome['last'].finish_reason in ('abort', 'length'), outcome
    calls = [lambda: p('hi'), lambda: list(p.stream_infer('hi')), lambda: p.chat('hi'),
             lambda: p.get_ppl([1, 2, 3]), lambda: p.end_session(1), lambda: p.infer(['a', 'b'])]
    for call in calls:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match='the pipeline is closed'):
            call()
        assert time.monotonic() - start < 1
    p.close()  # again: nothing happens
