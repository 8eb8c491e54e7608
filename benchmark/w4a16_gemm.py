"""The W4A16 kernel (devices/cuda/kernels/w4a16.py) against bf16 cuBLAS on Llama-3-8B's linear shapes.

For each shape (group 128) and row count M: the cuda GPTQ layer (CudaGptqLinear: the reference's unpacking,
then the repack) checked against the reference layer's apply (GptqLinear: dequantize, then F.linear), and
the time of one call of the kernel next to ``F.linear`` with a bf16 weight of the same shape, timed as CUDA
graph replays over enough copies of the weights that L2 holds none of them (a decode step reads each layer's
from memory). Where the table takes the fused kernel, its variants are timed too: the other way of unpacking the
int32s, and the weight dequantized in bf16 arithmetic (checked to give the same values).
GB/s: the weight bytes read (packed values, scales and zeros for W4A16) over the time, for M <= 16.

    PYTHONPATH=. python3 benchmark/w4a16_gemm.py
    PYTHONPATH=. python3 benchmark/w4a16_gemm.py --m 1 16 --shapes qkv down --desc-act
    PYTHONPATH=. python3 benchmark/w4a16_gemm.py --gemv-sweep --m 1 2 [--table-only]

``--gemv-sweep``: the GEMV kernel (up to 4 rows) with the table's tile and a grid of others, each checked
against the table's output, next to the split-K tensor-core kernel it replaced (``gemv=False``).

``--gemm-sweep``: at each --m (batched decode and prefill sizes, e.g. 16 64 128 256 512), the fused
tensor-core kernel over a grid of tiles (up to BLOCK_M 256, so that a tile's rows share one dequantization of
the weight), plain and with the operands swapped (the weight the left operand), and three ways of dequantizing
(MATHS), each checked against the table's output, next to the table's route (the fused tile, or the weight
dequantized, then cuBLAS) and bf16 cuBLAS; every shape at one M, then the next M.

    PYTHONPATH=. python3 benchmark/w4a16_gemm.py --gemm-sweep --m 16 64 128 256 512
"""
from __future__ import annotations

import argparse
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from torch import nn

from lmdeploy.devices.cuda.kernels import w4a16
from lmdeploy.devices.cuda.ops import CudaOps
from lmdeploy.devices.quant_formats import GptqLinear
from lmdeploy.devices.reference import ReferenceOps

SHAPES = [('qkv', 6144, 4096), ('o', 4096, 4096), ('gate_up', 28672, 4096), ('down', 4096, 14336),
          # Llama-3-70B's (not run by default)
          ('qkv70', 10240, 8192), ('o70', 8192, 8192), ('gate_up70', 57344, 8192), ('down70', 8192, 28672)]
GROUP = 128
COPY_BYTES = 1 << 30  # weights walked per replay at small M (well past the 50 MB of L2)


def gptq_layers(ops, n, k, desc_act, gen):
    """(cuda impl, its layer, reference impl, its layer) of one random GPTQ checkpoint (bf16 scales)."""
    config = {'quant_method': 'gptq', 'bits': 4, 'group_size': GROUP, 'desc_act': desc_act, 'sym': False}
    impl, ref_impl = ops.layer_impl('linear', 'gptq', config), GptqLinear(ReferenceOps(), config)
    mine, ref = nn.Module(), nn.Module()
    for i, layer in ((impl, mine), (ref_impl, ref)):
        i.create_weights(layer, k, n, False)
    groups = k // GROUP
    values = {'qweight': torch.randint(-2**31, 2**31, (k // 8, n), generator=gen, dtype=torch.int32),
              'qzeros': torch.randint(-2**31, 2**31, (groups, n // 8), generator=gen, dtype=torch.int32),
              'scales': (torch.rand(groups, n, generator=gen) * 0.004 + 0.001).bfloat16(),
              'g_idx': (torch.arange(k) // GROUP).int()}
    if desc_act:
        values['g_idx'] = values['g_idx'][torch.randperm(k, generator=gen)]
    for layer in (mine, ref):
        for name, v in values.items():
            getattr(layer, name).data = v.cuda()
    impl.process_weights(mine)
    ref_impl.process_weights(ref)
    return impl, mine, ref_impl, ref


def time_us(calls, reps=None):
    """Microseconds per call of ``calls`` (a list of thunks), replayed as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # warm-up (compiles) outside the graph
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    reps = reps or max(3, min(200, int(0.05 / max(once, 1e-6))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / reps / len(calls)


def copies_for(m, nbytes):
    """Weight copies a replay walks: ~1 GB at decode sizes; past L2 (50 MB) twice over where M > 64 (the GEMM
    mostly compute bound, fewer copies keep the run short)."""
    if m > 64:
        return max(2, min(8, (128 << 20) // nbytes + 1))
    return max(2, min(64, COPY_BYTES // nbytes))


def try_candidate(rows: list, base, call, timed, *tag):
    """One candidate of a sweep: ``call()``'s output checked against ``base``, then ``timed()`` (us) recorded as
    (us, *tag); inf where the output was wrong, nan (and the error's name) where it failed to build or run."""
    try:
        got = call()
        if not torch.allclose(got.float(), base.float(), rtol=2e-2, atol=2e-2 * base.abs().max().item()):
            rows.append((float('inf'), *tag))
            return
        rows.append((timed(), *tag))
    except Exception as e:  # (out of shared memory or registers)
        rows.append((float('nan'), *tag, type(e).__name__))


def tally(rows: list) -> str:
    return (f'({sum(1 for r in rows if r[0] == float("inf"))} wrong, {sum(1 for r in rows if r[0] != r[0])} '
            f'failed of {len(rows)})')


def weight_copies(qw, s, z, m):
    """(packed bytes of one weight, copies of it for a replay at M rows: the first the weight itself)."""
    w4_bytes = qw.numel() * 4 + s.numel() * 2 + z.numel() * 2
    return w4_bytes, [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(copies_for(m, w4_bytes) - 1)]


def bench_shape(ops, name, n, k, ms, desc_act, gen):
    impl, mine, ref_impl, ref = gptq_layers(ops, n, k, desc_act, gen)
    qw, s, z = mine.w4_qweight, mine.w4_scales, mine.w4_zeros
    for m in ms:
        try:
            x = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
            got, want = impl.apply(mine, x), ref_impl.apply(ref, x)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            cfg = w4a16.choose(m, n, k, mine.w4_group, ops._num_sms) or 'dequantize + cuBLAS'
            w4_bytes, packs = weight_copies(qw, s, z, m)
            n_bf = copies_for(m, n * k * 2)
            dense = [torch.randn(n, k, device='cuda', dtype=torch.bfloat16) / k**0.5 for _ in range(n_bf)]
            t_bf = time_us([lambda w=w: F.linear(x, w) for w in dense])
            del dense
            t_w4 = {}
            perm = mine.w4_perm
            xp = x if perm is None else x.index_select(1, perm)
            # the table's kernel, then its variants (where the table takes the fused kernel)
            for key, kw in (('table', {}), ('gather', dict(reshape=False)), ('f32-math', dict(dt_math=False))):
                if key != 'table' and isinstance(cfg, str):
                    t_w4[key] = float('nan')
                    continue
                t_w4[key] = time_us([
                    lambda p=p, kw=kw: w4a16.w4a16_linear(xp, *p, mine.w4_group, mine.w4_gidx, None, ops._num_sms,
                                                          **kw) for p in packs])
                if key == 'f32-math':  # the same values as the table's kernel
                    same = torch.equal(w4a16.w4a16_linear(xp, qw, s, z, mine.w4_group, mine.w4_gidx, None,
                                                          ops._num_sms, **kw), got)
                    t_w4[key] = t_w4[key] if same else float('inf')
            del packs
            bw = f'{w4_bytes / t_w4["table"] / 1e3:8.0f} {n * k * 2 / t_bf / 1e3:8.0f}' if m <= 16 else ' ' * 17
            print(f'{name:8s} {m:5d} {err:9.2e} {t_w4["table"]:9.1f} {t_w4["gather"]:9.1f} {t_w4["f32-math"]:9.1f} '
                  f'{t_bf:9.1f} {t_bf / t_w4["table"]:6.2f} {bw}  {cfg if isinstance(cfg, str) else tuple(cfg)}',
                  flush=True)
        except Exception as e:  # one failing configuration must not stop the table
            print(f'{name:8s} {m:5d} FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}',
                  flush=True)
            traceback.print_exc(limit=2)
        finally:
            torch.cuda.empty_cache()


def gemv_sweep(ops, name, n, k, ms, gen, table_only=False):
    """The GEMV kernel's tiles at decode rows: the table's choice, every candidate of a small grid (checked
    against the table's output), and the split-K tensor-core kernel it replaced (``gemv=False``)."""
    impl, mine, ref_impl, ref = gptq_layers(ops, n, k, False, gen)
    qw, s, z = mine.w4_qweight, mine.w4_scales, mine.w4_zeros
    w4_bytes, packs = weight_copies(qw, s, z, 1)
    for m in ms:
        x = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
        want = ref_impl.apply(ref, x).float()
        base = w4a16.w4a16_linear(x, qw, s, z, mine.w4_group, None, None, ops._num_sms)

        def run(**kw):
            return time_us([lambda p=p: w4a16.w4a16_linear(x, *p, mine.w4_group, None, None, ops._num_sms, **kw)
                            for p in packs])

        err = ((base.float() - want).abs().max() / want.abs().max()).item()
        table = w4a16.gemv_choose(m, n, k, mine.w4_group, ops._num_sms)
        old = run(gemv=False)
        rows = []
        for bp in () if table_only else (8, 16) if m == 1 else (8, ):  # (a smaller grid at more rows)
            for bn, warps in ((256, 2), (512, 4)):
                for per_sm in (4, 8) if m == 1 else (2, 4):
                    split = max(1, min(triton.cdiv(per_sm * ops._num_sms, triton.cdiv(n, bn)), k // 8 // bp))
                    cfg = w4a16.GemvConfig(bp, bn, split, warps, 1)
                    try_candidate(rows, base, lambda: w4a16.w4a16_linear(x, qw, s, z, mine.w4_group, None, None,
                                                                         ops._num_sms, gemv=cfg),
                                  lambda: run(gemv=cfg), cfg)
        best = sorted(r for r in rows if r[0] == r[0])[:5]
        t_table = run()
        print(f'{name:8s} M={m} err {err:.2e}  table {tuple(table)} {t_table:.1f} us '
              f'({w4_bytes / t_table / 1e3:.0f} GB/s)  tensor-core split-K {old:.1f} us', flush=True)
        for t, cfg in best:
            print(f'    {t:7.1f} us {w4_bytes / t / 1e3:6.0f} GB/s  {tuple(cfg)}', flush=True)
        print(f'    {tally(rows)}', flush=True)


# (BLOCK_M, BLOCK_N, warps) of the --gemm-sweep grid; each with BLOCK_K 64 / 128, 3 / 4 stages and every MATHS
GEMM_TILES = ((64, 128, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8), (256, 32, 8), (256, 64, 8))
# the same for the swapped tile (out^T = W x^T: BLOCK_N the weight's side, wgmma's left operand)
SWAP_TILES = ((16, 64, 4), (32, 64, 4), (32, 128, 4), (64, 128, 4), (128, 128, 4), (128, 128, 8), (256, 128, 8),
              (128, 256, 8))
TILES = {'plain': (False, GEMM_TILES), 'swapped': (True, SWAP_TILES)}  # --kernels: (Config.swap, its grid)
# how the fused kernel dequantizes: in float32, in bf16 after converting the nibbles, or in bf16 with the nibbles
# or-ed into a constant's mantissa (no conversion)
MATHS = {'f32-math': dict(dt_math=False), 'dt-math': dict(dt_math=True), 'magic': dict(dt_math=True, magic=True)}


KERNELS = tuple(TILES)


def sweep_configs(m, n, k, num_sms, kernels=KERNELS):
    """The grid's configs at M rows: tiles no taller than M needs (BLOCK_M up to max(64, M)), K split as the
    table splits it for that tile."""
    tall = max(64, triton.next_power_of_2(m))
    for swap, tiles in (TILES[kind] for kind in kernels):
        for bm, bn, warps in tiles:
            if bm > tall:
                continue
            for bk in (64, 128):
                for stages in (3, 4):
                    yield w4a16.Config(bm, bn, bk, w4a16.split_k(m, n, k, bm, bn, num_sms), warps, stages, swap)


def gemm_sweep(ops, shapes, ms, gen, kernels=KERNELS):
    """The fused kernels' tiles at M rows against the table's route and bf16 cuBLAS (us per call), every
    shape at one M before the next M."""
    layers = {name: gptq_layers(ops, n, k, False, gen)[1] for name, n, k in shapes}
    for m in ms:
        for name, n, k in shapes:
            gemm_sweep_one(ops, name, layers[name], n, k, m, kernels)


def gemm_sweep_one(ops, name, mine, n, k, m, kernels=KERNELS):
    t0 = time.time()
    qw, s, z = mine.w4_qweight, mine.w4_scales, mine.w4_zeros
    x = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
    base = w4a16.w4a16_linear(x, qw, s, z, mine.w4_group, None, None, ops._num_sms)
    _, packs = weight_copies(qw, s, z, m)

    def run(**kw):
        return time_us([lambda p=p: w4a16.w4a16_linear(x, *p, mine.w4_group, None, None, ops._num_sms, **kw)
                        for p in packs])

    dense = [torch.randn(n, k, device='cuda', dtype=torch.bfloat16) / k**0.5 for _ in range(copies_for(m, n * k * 2))]
    t_bf = time_us([lambda w=w: F.linear(x, w) for w in dense])
    del dense
    t_table = run()
    rows = []
    for cfg in sweep_configs(m, n, k, ops._num_sms, kernels):
        for math, kw in MATHS.items():
            try_candidate(rows, base, lambda: w4a16.w4a16_linear(x, qw, s, z, mine.w4_group, None, None,
                                                                 ops._num_sms, config=cfg, **kw),
                          lambda: run(config=cfg, **kw), cfg, math)
    best = sorted((r for r in rows if r[0] == r[0]), key=lambda r: r[0])[:5]
    route = tuple(w4a16.choose(m, n, k, GROUP, ops._num_sms) or ()) or 'dequantize + cuBLAS'
    print(f'{name:8s} M={m} table ({route}) {t_table:.1f} us  bf16 {t_bf:.1f} us  ({time.time() - t0:.0f} s)',
          flush=True)
    for t, cfg, math in best:
        print(f'    {t:7.1f} us  {t_bf / t:5.2f}x bf16  {t_table / t:5.2f}x table  {tuple(cfg)} {math}', flush=True)
    for swap in (False, True):
        for math in MATHS:  # each way of dequantizing at its best tile
            mine_best = min((r for r in rows if r[0] == r[0] and r[2] == math and r[1].swap == swap),
                            key=lambda r: r[0], default=None)
            if mine_best:
                print(f'    best {"swapped " if swap else ""}{math}: {mine_best[0]:.1f} us {tuple(mine_best[1])}',
                      flush=True)
    print(f'    {tally(rows)}', flush=True)
    del packs
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--m', type=int, nargs='+', default=[1, 4, 16, 64, 128, 256, 1024, 4096])
    p.add_argument('--shapes', nargs='+', default=[s[0] for s in SHAPES[:4]])
    p.add_argument('--desc-act', action='store_true', help='GPTQ desc_act (x gathered by the permutation)')
    p.add_argument('--gemv-sweep', action='store_true', help="the GEMV kernel's tile grid at each --m (<= 4)")
    p.add_argument('--table-only', action='store_true', help="with --gemv-sweep: the table's tile alone")
    p.add_argument('--gemm-sweep', action='store_true', help="the fused kernels' tile grid at each --m")
    p.add_argument('--kernels', nargs='+', choices=KERNELS, default=list(KERNELS), help='with --gemm-sweep')
    args = p.parse_args()
    ops = CudaOps()
    if args.gemm_sweep:
        gen = torch.Generator().manual_seed(0)
        gemm_sweep(ops, [sh for sh in SHAPES if sh[0] in args.shapes], args.m, gen, args.kernels)
        return
    if args.gemv_sweep:
        gen = torch.Generator().manual_seed(0)
        for name, n, k in SHAPES:
            if name in args.shapes:
                gemv_sweep(ops, name, n, k, [m for m in args.m if m <= 4], gen, args.table_only)
        return
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    print(f'{torch.cuda.get_device_name()}, {ops._num_sms} SMs, torch {torch.__version__}, triton '
          f'{__import__("triton").__version__}, group {GROUP}, desc_act {args.desc_act}')
    print('err: max |w4a16 - reference apply| / max |reference|; us: per call (CUDA graph replays, weights not in L2'
          ' for M <= 64); GB/s: weight bytes read per second (M <= 16)')
    print(f"{'shape':8s} {'M':>5s} {'err':>9s} {'w4a16 us':>9s} {'gather us':>9s} {'f32-math':>9s} {'bf16 us':>9s} "
          f"{'speedup':>6s} "
          f"{'w4 GB/s':>8s} {'bf16GB/s':>8s}  config (block_m, block_n, block_k, split, warps, stages)")
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        try:
            bench_shape(ops, name, n, k, args.m, args.desc_act, gen)
        except Exception as e:
            print(f'{name:8s} FAILED to build: {type(e).__name__}: {e}', flush=True)
            traceback.print_exc(limit=3)
        torch.cuda.empty_cache()
    print(f'({time.time() - t0:.0f} s; "gather us": the kernel unpacking by per-row loads instead of a reshape; '
          '"f32-math": dequantizing in float32 (the table dequantizes in the activation dtype up to DT_MATH_ROWS rows; '
          'inf: their values differed); nan: not the fused kernel)')


if __name__ == '__main__':
    main()
