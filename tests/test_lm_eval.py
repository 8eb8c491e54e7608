"""lm-evaluation-harness (the ``lm_eval`` package, unmodified) against the API server: the same small local
tasks (tests/data/lm_eval/) through lm_eval's ``local-completions`` / ``local-chat-completions`` models on
the server (SmolLM2-135M, cpu, float32) and through its ``hf`` model (transformers on the same weights)
score the same.

* ``lmdeploy_mc`` (multiple choice): lm_eval sends context + choice as token ids to ``/v1/completions``
  with ``echo: true, logprobs: 1, max_tokens: 1`` and sums the prompt's token logprobs after the context
  (all but the last entry, taken for the generated token): the accuracies are equal and every choice's
  loglikelihood is within 1e-3 of transformers' (its is-greedy flag the same), the choices after which
  the model ends its turn included (the stop token's entry comes last: see the comment below).
* ``lmdeploy_gen`` (greedy short answers, exact match): ``/v1/chat/completions`` with the model's chat
  template against transformers' greedy ``generate`` on the same template: the same answers, the same score.
"""
from __future__ import annotations

import math
import os

import pytest

lm_eval = pytest.importorskip('lm_eval', reason='lm_eval (lm-evaluation-harness) is not installed: '
                              "pip install -e '.[test]' installs it")
httpx = pytest.importorskip('httpx')
pytest.importorskip('fastapi')
pytest.importorskip('uvicorn')

from test_server import KEY, MODEL, assert_clean, start_server, stop_server  # noqa: E402

TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'lm_eval')
# explicitly greedy, whatever the task or the model's generation_config.json say
GREEDY = {'do_sample': False, 'temperature': 0}
LL_TOLERANCE = 1e-3
# A completion that ends on a stop token (the model's end of turn) reports that token's logprobs entry after
# the generated ones (as vLLM does; its text is not in the choice's text): lm_eval's local-completions sends
# max_tokens 1 and drops the last entry as the generated token, so without it the continuation's last token
# would be lost (this test found that: 3 of lmdeploy_mc's 128 choices scored wrong before the fix).


@pytest.fixture(scope='module')
def srv(smollm2_path):
    s = start_server(smollm2_path)
    yield s
    stop_server(s)


@pytest.fixture(scope='module')
def task_manager():
    """The tasks of tests/data/lm_eval alone: indexing lm_eval's thousands of built-in task files too (its
    default) takes about 10 s and none of them is used."""
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=TASKS, include_defaults=False)


@pytest.fixture(scope='module')
def hf_lm(smollm2_path):
    """lm_eval's own transformers backend on the same weights, built once for both tasks."""
    from lm_eval.models.huggingface import HFLM
    return HFLM(pretrained=smollm2_path, dtype='float32', device='cpu', batch_size=32)


def evaluate(model, model_args, task: str, task_manager, **kwargs) -> dict:
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=task_manager,
                                  log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0, **kwargs)
    assert out is not None
    samples = sorted(out['samples'][task], key=lambda s: s['doc_id'])
    return {'results': out['results'][task], 'samples': samples}


def test_echo_prompt_logprobs(srv, smollm2_path):
    """What lm_eval's local-completions reads from an echo reply, checked directly first (a clear failure
    here rather than lm_eval's retries): a token-id prompt with echo, logprobs 1 and max_tokens 1 gives
    the prompt's tokens then the completion's, the first prompt token's logprob null, one top logprob per
    position, and the text prompt + completion."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = ['Question: What is the capital of France?\nAnswer: Paris', 'Question: What is 2 + 2?\nAnswer: 4']
    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    r = httpx.post(srv.url + '/v1/completions', headers={'Authorization': f'Bearer {KEY}'}, timeout=120,
                   json={'model': MODEL, 'prompt': ids, 'echo': True, 'logprobs': 1, 'max_tokens': 1,
                         'temperature': 0, 'seed': 1234})
    assert r.status_code == 200, f'/v1/completions with echo: {r.status_code} {r.text}'
    choices = sorted(r.json()['choices'], key=lambda c: c['index'])
    assert len(choices) == len(prompts)
    for prompt, prompt_ids, choice in zip(prompts, ids, choices):
        lp = choice['logprobs']
        n = len(prompt_ids) + 1  # the prompt's tokens, then the one completion token
        assert len(lp['tokens']) == len(lp['token_logprobs']) == len(lp['top_logprobs']) == n, lp
        assert lp['token_logprobs'][0] is None
        assert all(isinstance(x, float) and x <= 0 and math.isfinite(x) for x in lp['token_logprobs'][1:])
        assert choice['text'].startswith(prompt), choice['text']
        assert ''.join(lp['tokens'][:-1]) == prompt
        for token_lp, top in zip(lp['token_logprobs'][1:], lp['top_logprobs'][1:]):
            assert len(top) >= 1 and max(top.values()) >= token_lp - 1e-6
        # the completion token is greedy: the best of its position
        assert lp['token_logprobs'][-1] == max(lp['top_logprobs'][-1].values())
    assert_clean(srv)


@pytest.fixture(scope='module')
def mc_runs(srv, smollm2_path, task_manager, hf_lm):
    """lmdeploy_mc through local-completions (32 prompts a request, the engine batches them) and through hf."""
    ours = evaluate('local-completions', {
        'model': MODEL, 'base_url': srv.url + '/v1/completions', 'tokenizer_backend': 'huggingface',
        'tokenizer': smollm2_path, 'batch_size': 32, 'max_retries': 1, 'timeout': 300,
        'header': {'Authorization': f'Bearer {KEY}'}}, 'lmdeploy_mc', task_manager)
    ref = evaluate(hf_lm, None, 'lmdeploy_mc', task_manager)
    assert len(ours['samples']) == len(ref['samples']) == 32
    for a, b in zip(ours['samples'], ref['samples']):
        assert a['doc_id'] == b['doc_id'] and a['arguments'] == b['arguments']
        assert len(a['resps']) == len(b['resps']) == 4
    print(f"lmdeploy_mc: acc {ours['results']['acc,none']} (hf {ref['results']['acc,none']}), acc_norm "
          f"{ours['results']['acc_norm,none']} (hf {ref['results']['acc_norm,none']})")
    return ours, ref


def test_multiple_choice_accuracy_matches_hf(srv, mc_runs):
    ours, ref = mc_runs
    for metric in ('acc,none', 'acc_norm,none'):
        assert ours['results'][metric] == ref['results'][metric], metric
    # the task is not trivial for the model either way
    assert 0.2 < ref['results']['acc,none'] < 1
    assert_clean(srv)


def test_multiple_choice_loglikelihoods_match_hf(mc_runs):
    """Every choice's loglikelihood within LL_TOLERANCE of hf's, its is-greedy flag and the item's acc /
    acc_norm the same (choices after which the model ends its turn included: see the comment above)."""
    ours, ref = mc_runs
    wrong, worst = [], 0.0
    for a, b in zip(ours['samples'], ref['samples']):
        for (ll_a, greedy_a), (ll_b, greedy_b), (_, cont) in zip(
                (r[0] for r in a['resps']), (r[0] for r in b['resps']), a['arguments']):
            worst = max(worst, abs(ll_a - ll_b))
            if abs(ll_a - ll_b) > LL_TOLERANCE or greedy_a != greedy_b:
                wrong.append((a['doc']['question'], cont, ll_a, ll_b, greedy_a, greedy_b))
        if (a['acc'], a['acc_norm']) != (b['acc'], b['acc_norm']):
            wrong.append((a['doc']['question'], 'acc / acc_norm', a['acc'], b['acc'], a['acc_norm'], b['acc_norm']))
    print(f'lmdeploy_mc: largest loglikelihood difference from hf {worst:.1e}')
    assert not wrong, '\n'.join(map(str, wrong))


def test_echo_completion_ending_on_stop_token(srv, smollm2_path):
    """lm_eval's contract (vLLM's and OpenAI's too): with max_tokens 1 the logprobs hold the prompt's tokens
    and one more, whatever token came, a stop token too. SmolLM2's greedy token after this prompt is
    <|im_end|>, its end of turn: lm_eval reads token_logprobs[ctxlen:-1], so a reply without that last
    entry would lose the continuation's last token (" Earth" would score 0). Its text stays out of the
    choice's text."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tok('Question: Which planet do we live on?\nAnswer: Earth', add_special_tokens=False).input_ids
    r = httpx.post(srv.url + '/v1/completions', headers={'Authorization': f'Bearer {KEY}'}, timeout=120,
                   json={'model': MODEL, 'prompt': ids, 'echo': True, 'logprobs': 1, 'max_tokens': 1,
                         'temperature': 0})
    assert r.status_code == 200, r.text
    choice = r.json()['choices'][0]
    assert choice['finish_reason'] == 'stop'  # the model ends its turn here (what the test is about)
    lp = choice['logprobs']
    assert len(lp['tokens']) == len(lp['token_logprobs']) == len(ids) + 1, lp['tokens'][-3:]
    assert isinstance(lp['token_logprobs'][-1], float) and lp['tokens'][-1] == tok.eos_token
    assert choice['text'] == tok.decode(ids)  # (the stop token's text is not the choice's)
    assert_clean(srv)


def test_generation_matches_hf(srv, task_manager, hf_lm):
    """lmdeploy_gen through local-chat-completions (the server's chat template; 12 requests at once) and
    through hf's greedy generate on the tokenizer's chat template: the same answers, the same exact match."""
    ours = evaluate('local-chat-completions', {
        'model': MODEL, 'base_url': srv.url + '/v1/chat/completions', 'num_concurrent': 12, 'max_retries': 1,
        'timeout': 300, 'header': {'Authorization': f'Bearer {KEY}'}}, 'lmdeploy_gen', task_manager,
        apply_chat_template=True, gen_kwargs=dict(GREEDY))
    ref = evaluate(hf_lm, None, 'lmdeploy_gen', task_manager, apply_chat_template=True, gen_kwargs=dict(GREEDY))
    assert len(ours['samples']) == len(ref['samples']) == 12
    for a, b in zip(ours['samples'], ref['samples']):
        assert a['doc_id'] == b['doc_id']
        assert a['resps'] == b['resps'], (a['doc'], a['resps'], b['resps'])
        assert a['filtered_resps'] == b['filtered_resps']
        assert a['exact_match'] == b['exact_match']
    key = 'exact_match,last_word'
    print(f'lmdeploy_gen: exact match {ours["results"][key]} (hf {ref["results"][key]})')
    assert ours['results'][key] == ref['results'][key]
    assert 0 < ref['results'][key] < 1
    assert_clean(srv)
