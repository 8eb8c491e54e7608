"""Attention of a step that carries one-token rows and prompt rows: the
decode call and the prefill call one after the other (as the layer runs
them), against the decode call on a second stream running beside the
prefill call.

The decode call reads the carried rows' whole contexts (memory-bound); the
prefill call multiplies prompt tiles (tensor-core-bound). Run side by side,
one can fill what the other leaves idle. Llama-3-8B's attention shape,
a 16-bit cache of 64-token blocks handed out in random order, each call a
CUDA graph replay (the side stream forks and joins inside the graph).

    python benchmark/mixed_attn_overlap.py                       # gpu_suite.sh prefill's step
    python benchmark/mixed_attn_overlap.py --decode 84 250 --decode-context 3000 300
"""
from __future__ import annotations

import argparse

import torch

from bench_utils import random_paged_cache, rel_err
from lmdeploy.devices import get_device

H, HKV, D, BLOCK = 32, 8, 128, 64
PROMPTS = {
    'prefill3000': [(3000, 3000), (3000, 3000), (2028, 2028)],  # gpu_suite.sh prefill, one step
    'refill': [(150, 150)] * 30,  # a throughput-workload refill step (~4,500 prompt tokens)
    'serve': [(186, 186)],  # one new prompt among the serving workload's decode rows
}


def build(nd: int, dctx: int, prompts, policy: int, seed: int = 0):
    ops = get_device('cuda')
    spec = ops.kv_cache_spec(HKV, D, BLOCK, torch.bfloat16, policy)
    lens = [dctx] * nd + [n for n, _ in prompts]
    gen = torch.Generator(device='cuda').manual_seed(seed)
    cache, tables = random_paged_cache(spec, lens, gen)
    q_lens = [1] * nd + [m for _, m in prompts]
    q = torch.randn(sum(q_lens), H, D, dtype=torch.bfloat16, device='cuda', generator=gen)
    ql = torch.tensor(q_lens, device='cuda', dtype=torch.int64)
    kvl = torch.tensor(lens, device='cuda', dtype=torch.int64)
    starts = torch.cumsum(ql, 0) - ql
    order = torch.tensor(sorted(range(nd), key=lambda i: -lens[i]), dtype=torch.int64, device='cuda')
    torch.cuda.synchronize()
    return ops, cache, tables, q, ql, kvl, starts, order, max(q_lens[nd:]), max(lens)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--prompts', nargs='+', default=['prefill3000'], choices=list(PROMPTS))
    p.add_argument('--decode', type=int, nargs='+', default=[84], help='one-token rows carried')
    p.add_argument('--decode-context', type=int, nargs='+', default=[3000])
    p.add_argument('--policy', type=int, nargs='+', default=[0])
    args = p.parse_args()
    from triton.testing import do_bench_cudagraph
    scale = D**-0.5
    print(f'mixed-step attention on {torch.cuda.get_device_name()}')
    print('| prompts | decode rows x context | policy | decode alone | prefill alone | one after the other | '
          'side stream | side stream, high priority | saved |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- | --- |')
    for name in args.prompts:
        for nd in args.decode:
            for dctx in args.decode_context:
                for policy in args.policy:
                    ops, cache, tables, q, ql, kvl, starts, order, mq, mkv = build(nd, dctx, PROMPTS[name], policy)
                    out = torch.empty_like(q)

                    def decode():
                        ops.paged_decode_attention(q[:nd], cache, tables[:nd], kvl[:nd], scale, mkv, order,
                                                   out=out[:nd])

                    def prefill():
                        ops.paged_prefill_attention(q, cache, tables[nd:], starts[nd:], ql[nd:], kvl[nd:], scale,
                                                    mq, mkv, out=out)

                    def both():
                        decode()
                        prefill()

                    def side_by_side(stream):
                        def run():
                            main_stream = torch.cuda.current_stream()
                            stream.wait_stream(main_stream)
                            with torch.cuda.stream(stream):
                                decode()
                            prefill()
                            main_stream.wait_stream(stream)
                        return run

                    both()
                    want = out.clone()
                    out.zero_()
                    side_by_side(torch.cuda.Stream())()
                    torch.cuda.synchronize()
                    err = rel_err(out, want)
                    assert err < 1e-3, err
                    times = [1e3 * do_bench_cudagraph(f) for f in (
                        decode, prefill, both, side_by_side(torch.cuda.Stream()),
                        side_by_side(torch.cuda.Stream(priority=-1)))]
                    best = min(times[3:])
                    print(f'| {name} | {nd} x {dctx} | {policy} | ' + ' | '.join(f'{t:.1f}' for t in times) +
                          f' | {times[2] - best:.1f} us ({(times[2] - best) / times[2]:.0%}) |', flush=True)


if __name__ == '__main__':
    main()
