"""End to end on a GPU, bf16: greedy tokens vs transformers, logits by relative error.

Skipped without CUDA. For random-weight Llama and Qwen2 shapes: the first 16
greedy tokens of each prompt match transformers, or where they diverge, the
logits' relative error at every step before the divergence is under 1e-2.
Runs with CUDA graphs and in eager mode.
"""
import os
import random
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'benchmark'))

NEW = 16


@pytest.fixture(scope='module', params=['llama-small', 'qwen2-small'])
def model_dir(request, tmp_path_factory):
    from random_model import make_model
    return make_model(request.param, str(tmp_path_factory.mktemp(request.param)), dtype='bfloat16')


def hf_reference(path, prompts):
    """transformers in bf16: greedy tokens and their step logits; and the
    float32 model's logits on the same (bf16-chosen) tokens, the truth both
    bf16 implementations approximate."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids], device='cuda')
        with torch.no_grad():
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW,
                               do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                               eos_token_id=None)
        out.append([g.sequences[0, len(ids):].tolist(), torch.cat(g.logits).float().cpu()])
    model.float()
    for (new, _), ids, entry in zip(out, prompts, out):
        with torch.no_grad():
            full = torch.tensor([ids + new], device='cuda')
            entry.append(model(full).logits[0, len(ids) - 1:len(ids) - 1 + NEW].float().cpu())
    del model
    torch.cuda.empty_cache()
    return out


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize('eager,stagger', [(False, False), (True, False), (False, True)])
def test_bf16_greedy_and_logits_match_transformers(model_dir, eager, stagger, monkeypatch):
    """stagger: each prompt arrives once the one before has its first tokens, so its prefill shares a step
    with decoding rows: such steps replay a recording of their padded token count unless eager."""
    from engine_utils import submit

    from lmdeploy.engine.engine import Engine
    from lmdeploy.engine.graph_runner import GraphRunner
    mixed = []
    call = GraphRunner._mixed

    def spy(self, input_ids, positions, ctx):
        mixed.append(ctx.num_decode)
        return call(self, input_ids, positions, ctx)
    monkeypatch.setattr(GraphRunner, '_mixed', spy)
    from lmdeploy.engine.sequence import SamplingParams
    from lmdeploy.messages import PytorchEngineConfig
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(n)] for n in (1, 7, 64, 200, 513, 1000)]
    ref = hf_reference(model_dir, prompts)
    engine = Engine(model_dir, PytorchEngineConfig(device_type='cuda', dtype='bfloat16', eager_mode=eager,
                                                   session_len=2048, cache_max_entry_count=0.2, block_size=64))
    mixed.clear()  # the start-up warm-up's own mixed steps (engine/warmup.py) are not the test's
    try:
        cols = []
        for p in prompts:
            cols.append(submit(engine, p, SamplingParams(max_new_tokens=NEW, output_logits='generation')))
            while stagger and len(cols[-1].token_ids) < 2:
                cols[-1].done.wait(0.001)
        rows = []
        for (want, want_logits, truth), col in zip(ref, cols):
            col.wait()
            got = col.token_ids
            assert col.final.error is None, col.final.error
            logits = torch.cat([o.logits for o in col.outputs if o.logits is not None]).float()
            assert logits.shape[0] == NEW
            same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), NEW)
            steps = range(min(same + 1, NEW))  # contexts identical to transformers'
            errs = [rel(logits[i], want_logits[i]) for i in steps]
            ours_vs_fp32 = max(rel(logits[i], truth[i]) for i in steps)
            theirs_vs_fp32 = max(rel(want_logits[i], truth[i]) for i in steps)
            rows.append((same, max(errs), ours_vs_fp32, theirs_vs_fp32))
        print(f'\n[{os.path.basename(model_dir)} eager={eager}] per prompt: (tokens equal to transformers-bf16, '
              'max logits rel err vs it, ours vs fp32, transformers-bf16 vs fp32): '
              + ', '.join(f'({r[0]}, {r[1]:.2e}, {r[2]:.2e}, {r[3]:.2e})' for r in rows))
        for same, err, ours, theirs in rows:
            # the criterion: all 16 match, or the logits agree until they diverge
            assert same == NEW or err < 1e-2, rows
            # and we are no further from the float32 truth than transformers' own bf16
            assert ours <= 1.25 * theirs + 1e-3, rows
        engine.wait_idle()
        engine.check_invariants()
        if not eager:  # every step with prompt rows replayed a recording; staggered ones carried decode rows
            assert len(mixed) == engine.stats().extra['prefill_steps'] > 0
            if stagger:  # (a one-token prompt is a one-token row too, so only counts tell)
                assert max(mixed) >= 3, mixed
    finally:
        engine.close()


def test_openai_fields_with_cuda_graphs(model_dir):
    """Echo's prompt logprobs against transformers' float32 logits (relative error), a logit_bias that forces
    a token and penalties that follow OpenAI's formula, all in one batch with plain requests, decode steps
    replaying CUDA graphs."""
    from engine_utils import submit
    from transformers import AutoModelForCausalLM

    from lmdeploy.engine.engine import Engine
    from lmdeploy.engine.sequence import SamplingParams
    from lmdeploy.messages import PytorchEngineConfig
    rng = random.Random()
    prompts = [[rng.randrange(3, 32000) for _ in range(n)] for n in (40, 300, 9, 120)]
    forced = rng.randrange(3, 32000)
    freq, pres = rng.uniform(0.5, 2.0), rng.uniform(0.0, 2.0)
    engine = Engine(model_dir, PytorchEngineConfig(device_type='cuda', dtype='bfloat16', session_len=2048,
                                                   cache_max_entry_count=0.2, block_size=64))
    try:
        cols = [submit(engine, prompts[0], SamplingParams(max_new_tokens=4, prompt_logprobs=2)),
                submit(engine, prompts[1], SamplingParams(max_new_tokens=NEW, logit_bias={forced: 100.0})),
                submit(engine, prompts[2], SamplingParams(max_new_tokens=NEW, frequency_penalty=freq,
                                                          presence_penalty=pres, output_logits='generation')),
                submit(engine, prompts[3], SamplingParams(max_new_tokens=NEW))]
        for c in cols:
            c.wait()
            assert c.final.error is None, c.final.error
        assert engine.stats().extra.get('decode_steps', 0) > 0
        lps = [e for o in cols[0].outputs for e in (o.prompt_logprobs or [])]
        assert len(lps) == len(prompts[0]) and lps[0] is None
        assert cols[1].token_ids == [forced] * NEW
        ids = cols[2].token_ids
        logits = torch.cat([o.logits for o in cols[2].outputs if o.logits is not None]).double()
        counts = torch.zeros(logits.shape[1], dtype=torch.float64)
        for t, row in zip(ids, logits):
            adjusted = row - counts * freq - (counts > 0).double() * pres
            top2 = adjusted.topk(2).values
            if float(top2[0] - top2[1]) > 1e-3:
                assert int(adjusted.argmax()) == t
            counts[t] += 1
    finally:
        engine.close()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        truth = model(torch.tensor([prompts[0]], device='cuda')).logits[0].float().log_softmax(-1).cpu()
    want = torch.tensor([float(truth[k - 1, prompts[0][k]]) for k in range(1, len(prompts[0]))])
    got = torch.tensor([lps[k][prompts[0][k]] for k in range(1, len(prompts[0]))])
    # (a random model's logprobs all sit near -log V: compare how they vary, which a shifted position breaks)
    centered = rel(got - got.mean(), want - want.mean())
    print(f'\n[{os.path.basename(model_dir)}] prompt logprobs vs float32: max abs err '
          f'{float((got - want).abs().max()):.2e}, rel err of the deviations from their mean {centered:.2e}')
    assert centered < 0.1
    del model
    torch.cuda.empty_cache()
