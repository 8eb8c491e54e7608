"""Issue 38's cross-engine check: vLLM and this engine greedy-decode the same `lite` AWQ / GPTQ checkpoints.

Each engine runs in its own process (vLLM's site is not this package's environment) and writes what it
decoded to JSON; ``compare`` reads both. The same 32 prompts of random token ids (seeded) go to both, each
decoded greedily for 32 tokens, ignore_eos; each step records the chosen token and the top-5 logprobs.

    PYTHONPATH=. python3 benchmark/quant_agree.py make --out /tmp/qa          # base + lite awq, gptq, gptq_act
    PYTHONPATH=. python3 benchmark/quant_agree.py ours --model /tmp/qa/awq --json /tmp/qa/awq.ours.json
    (cd benchmark && PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python3 quant_agree.py vllm \\
        --model /tmp/qa/awq --json /tmp/qa/awq.vllm.json)
    python3 benchmark/quant_agree.py compare /tmp/qa/awq.ours.json /tmp/qa/awq.vllm.json

The verdict, per prompt: the tokens are equal, or they first differ at a step where both engines see a near
tie, each engine's logprob gap between the two tokens at most ``--tie`` (2e-2) times the larger of the two
tokens' logits in magnitude (ours; bf16 logits are 2^-8 relative apart). Alongside: the largest difference
of the two engines' logprobs over the steps where both took the same path (vLLM's top-5 tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Dict, List

PROMPTS, NEW_TOKENS, TOP = 32, 32, 5
TIE = 2e-2


def make_prompts(vocab: int, seed: int = 0, n: int = PROMPTS) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randrange(16, 200))] for _ in range(n)]


def _vocab(model: str) -> int:
    with open(os.path.join(model, 'config.json')) as f:
        return json.load(f)['vocab_size']


def make(out: str, shape: str, device: str):
    """A random bf16 model of ``shape`` (``base``: the bf16 control) and its lite AWQ, GPTQ and GPTQ act-order
    checkpoints under ``out``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from random_model import make_model

    from lmdeploy import lite
    base = make_model(shape, os.path.join(out, 'base'), dtype='bfloat16')
    kw = dict(calib_samples=8, calib_seqlen=256, device=device, progress=False)
    lite.auto_awq(base, os.path.join(out, 'awq'), **kw)
    # symmetric GPTQ: vLLM 0.25.1 rejects 4-bit GPTQ with zero points ("Unsupported quantization config: bits=4,
    # sym=False", seen on the GPU machine); lite's asymmetric default is checked on the CPU
    lite.auto_gptq(base, os.path.join(out, 'gptq'), sym=True, **kw)
    lite.auto_gptq(base, os.path.join(out, 'gptq_act'), sym=True, desc_act=True, **kw)
    print(out)


def run_ours(model: str, device: str, dtype: str, prompts: List[List[int]], new_tokens: int) -> List[dict]:
    import threading

    import torch

    from lmdeploy.engine.engine import Engine, EngineRequest
    from lmdeploy.engine.sequence import SamplingParams
    from lmdeploy.messages import PytorchEngineConfig
    engine = Engine(model, PytorchEngineConfig(device_type=device, dtype=dtype, session_len=1024,
                                               max_batch_size=len(prompts), cache_max_entry_count=0.3))
    results = [None] * len(prompts)
    done = threading.Semaphore(0)

    def collector(i):
        outs = []

        def on_output(o):
            outs.append(o)
            if o.finished:
                logits = torch.cat([x.logits.float() for x in outs if x.logits is not None])
                results[i] = (sum((x.new_token_ids for x in outs), []), logits)
                done.release()
        return on_output

    try:
        for i, ids in enumerate(prompts):
            params = SamplingParams(max_new_tokens=new_tokens, greedy=True, output_logits='generation')
            engine.submit(EngineRequest(900_000 + i, list(ids), params, collector(i)))
        for _ in prompts:
            if not done.acquire(timeout=600):
                raise TimeoutError('this engine did not finish the prompts')
    finally:
        engine.close()
    rows = []
    for tokens, logits in results:
        lp = torch.log_softmax(logits, dim=-1)
        top = lp.topk(TOP, dim=-1)
        chosen = torch.tensor(tokens)
        rows.append({'tokens': tokens,
                     'top': [dict(zip(map(int, t), map(float, v))) for t, v in zip(top.indices, top.values)],
                     'chosen_logit': logits.gather(1, chosen[:, None])[:, 0].tolist()})
    return rows


def run_vllm(model: str, prompts: List[List[int]], new_tokens: int, dtype: str = 'bfloat16',
             quantization=None) -> List[dict]:
    """``quantization``: vLLM's method by name (e.g. 'awq' for its plain AWQ kernel, float16 only), else its
    choice (AWQ-Marlin / Machete on Hopper)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=model, dtype=dtype, max_model_len=1024, gpu_memory_utilization=0.5, seed=0,
              enforce_eager=True, quantization=quantization)  # (no compile or graph capture: the tokens)
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append({'tokens': list(c.token_ids),
                     'top': [{int(t): float(v.logprob) for t, v in step.items()} for step in c.logprobs]})
    return rows


def verdict(ours: dict, theirs: dict, tie: float = TIE) -> Dict:
    """One prompt: {'equal': steps both took the same token before the first difference, 'ok': bool,
    'why': text, 'max_dlogprob': largest |logprob difference| over the shared steps' tokens both report}."""
    a, b = ours['tokens'], theirs['tokens']
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    dl = 0.0
    for step in range(first):
        for tok, lp in theirs['top'][step].items():
            if tok in ours['top'][step]:
                dl = max(dl, abs(ours['top'][step][tok] - lp))
    if first == len(a) == len(b):
        return {'equal': first, 'ok': True, 'why': 'same tokens', 'max_dlogprob': dl}
    if first >= min(len(a), len(b)):
        return {'equal': first, 'ok': False, 'why': f'lengths differ ({len(a)} against {len(b)})', 'max_dlogprob': dl}
    ta, tb = a[first], b[first]
    lo, lt = ours['top'][first], theirs['top'][first]
    if tb not in lo or ta not in lt:
        return {'equal': first, 'ok': False, 'max_dlogprob': dl,
                'why': f'step {first}: {ta} against {tb}, outside the other\'s top {TOP}'}
    gap_ours, gap_theirs = lo[ta] - lo[tb], lt[tb] - lt[ta]
    scale = abs(ours['chosen_logit'][first]) if ours.get('chosen_logit') else 1.0
    ok = max(abs(gap_ours), abs(gap_theirs)) <= tie * max(scale, 1.0)
    return {'equal': first, 'ok': ok, 'max_dlogprob': dl,
            'why': f'step {first}: {ta} against {tb}, gaps {gap_ours:.3g} (ours) / {gap_theirs:.3g} (vLLM), '
                   f'logit {scale:.3g}: {"a near tie" if ok else "not a tie"}'}


def compare(ours_path: str, theirs_path: str, tie: float = TIE) -> bool:
    with open(ours_path) as f:
        ours = json.load(f)
    with open(theirs_path) as f:
        theirs = json.load(f)
    vs = [verdict(o, t, tie) for o, t in zip(ours['rows'], theirs['rows'])]
    same = sum(v['why'] == 'same tokens' for v in vs)
    good = sum(v['ok'] for v in vs)
    print(f'{ours["model"]}: {same}/{len(vs)} prompts with equal tokens, {good}/{len(vs)} equal or diverging at a '
          f'near tie; largest logprob difference on shared steps {max(v["max_dlogprob"] for v in vs):.3g}')
    for i, v in enumerate(vs):
        if v['why'] != 'same tokens':
            print(f'  prompt {i}: {v["why"]}')
    return good == len(vs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='cmd', required=True)
    m = sub.add_parser('make')
    m.add_argument('--out', required=True)
    m.add_argument('--shape', default='llama-small')
    m.add_argument('--device', default='cuda')
    for name in ('ours', 'vllm'):
        r = sub.add_parser(name)
        r.add_argument('--model', required=True)
        r.add_argument('--json', required=True)
        r.add_argument('--seed', type=int, default=0)
        r.add_argument('--prompts', type=int, default=PROMPTS)
        r.add_argument('--new-tokens', type=int, default=NEW_TOKENS)
        r.add_argument('--dtype', default='bfloat16')
        if name == 'ours':
            r.add_argument('--device', default='cuda')
        else:
            r.add_argument('--quantization', default=None, help="vLLM's method by name (default: its choice)")
    c = sub.add_parser('compare')
    c.add_argument('ours')
    c.add_argument('theirs')
    c.add_argument('--tie', type=float, default=TIE)
    args = p.parse_args()
    if args.cmd == 'make':
        return make(args.out, args.shape, args.device)
    if args.cmd == 'compare':
        sys.exit(0 if compare(args.ours, args.theirs, args.tie) else 1)
    prompts = make_prompts(_vocab(args.model), args.seed, args.prompts)
    if args.cmd == 'ours':
        rows = run_ours(args.model, args.device, args.dtype, prompts, args.new_tokens)
    else:
        rows = run_vllm(args.model, prompts, args.new_tokens, args.dtype, args.quantization)
    with open(args.json, 'w') as f:
        json.dump({'model': args.model, 'engine': args.cmd, 'rows': rows}, f)


if __name__ == '__main__':
    main()
