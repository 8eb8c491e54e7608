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
