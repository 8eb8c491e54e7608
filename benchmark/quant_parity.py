"""Quantized checkpoints end to end on a GPU against the cpu reference.

A small random Llama is quantized by ``lmdeploy lite``: AWQ, GPTQ (plain, act-order, symmetric) and
SmoothQuant int8 and fp8. Each checkpoint then runs three ways:

* the cuda engine in bf16 (the device's quantized kernels);
* the cpu engine in bf16 and in float32 (the reference layers).

For each pair the script prints the prompt logits' relative error and the step at which greedy tokens first
differ. The unquantized model's row is the baseline: it shows how far bf16 alone moves the logits. A kernel
that is right adds nothing beyond that.

    PYTHONPATH=. python3 benchmark/quant_parity.py [--only awq,sq_int8] [--device cuda]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NEW_TOKENS = 16


def quantize_all(base: str, root: str, device: str, only):
    from lmdeploy import lite
    kw = dict(calib_samples=4, calib_seqlen=128, device=device, progress=False)
    jobs = [('awq', lambda o: lite.auto_awq(base, o, n_grid=5, **kw)),
            ('gptq', lambda o: lite.auto_gptq(base, o, **kw)),
            ('gptq_act', lambda o: lite.auto_gptq(base, o, desc_act=True, **kw)),
            ('gptq_sym', lambda o: lite.auto_gptq(base, o, sym=True, **kw)),
            ('sq_int8', lambda o: lite.smooth_quant(base, o, quant_dtype='int8', **kw)),
            ('sq_fp8', lambda o: lite.smooth_quant(base, o, quant_dtype='fp8', **kw))]
    ckpts = {'bf16': base}
    for name, job in jobs:
        if only and name not in only:
            continue
        t0 = time.time()
        try:
            job(os.path.join(root, name))
        except Exception as e:  # one format failing must not hide the others
            print(f'{name}: quantization failed: {type(e).__name__}: {e}', flush=True)
            continue
        ckpts[name] = os.path.join(root, name)
        print(f'{name}: quantized in {time.time() - t0:.1f} s', flush=True)
    return ckpts


def run(path: str, device: str, dtype: str, prompts_ids):
    """(generated token ids, logits [prompt + generated, vocab] float32 on the cpu) per prompt."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    cfg = PytorchEngineConfig(device_type=device, dtype=dtype, session_len=1024, max_batch_size=len(prompts_ids))
    with pipeline(path, backend_config=cfg) as pipe:
        prompts = [pipe.tokenizer.decode(ids) for ids in prompts_ids]
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, output_logits='all')
        out = pipe(prompts, gen)
    return [(o.token_ids, o.logits.float().cpu()) for o in out]


def compare(a, b) -> str:
    errs, same = [], []
    for (ta, la), (tb, lb) in zip(a, b):
        p = min(len(la), len(lb)) - NEW_TOKENS - 1  # the prompt's rows: both engines saw the same tokens
        errs.append(float((la[:p] - lb[:p]).norm() / lb[:p].norm()))
        same.append(next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(tb)))
    return f'rel err max {max(errs):.2e} mean {sum(errs) / len(errs):.2e}; tokens equal before step {same}'


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cuda')
    p.add_argument('--only', default=None, help='comma-separated formats (default: all)')
    p.add_argument('--prompts', type=int, default=8)
    args = p.parse_args()
    from random_model import make_model
    only = set(args.only.split(',')) if args.only else None
    root = tempfile.mkdtemp(prefix='quant_parity_')
    base = make_model('llama-small', os.path.join(root, 'base'), dtype='bfloat16')
    ckpts = quantize_all(base, root, args.device, only)
    rng = random.Random(0)
    prompts_ids = [[rng.randrange(100, 31000) for _ in range(rng.randrange(20, 200))] for _ in range(args.prompts)]
    for name, path in ckpts.items():
        dev = run(path, args.device, 'bfloat16', prompts_ids)
        cpu16 = run(path, 'cpu', 'bfloat16', prompts_ids)
        cpu32 = run(path, 'cpu', 'float32', prompts_ids)
        print(f'{name}\n  {args.device} bf16 vs cpu bf16: {compare(dev, cpu16)}'
              f'\n  {args.device} bf16 vs cpu fp32: {compare(dev, cpu32)}'
              f'\n  cpu bf16 vs cpu fp32 (bf16 alone): {compare(cpu16, cpu32)}', flush=True)


if __name__ == '__main__':
    main()
