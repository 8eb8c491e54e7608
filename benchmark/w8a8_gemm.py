"""SmoothQuant W8A8 linears on one GPU: the cuda device's int8 and fp8 implementations (devices/cuda/w8a8.py:
per-token quantize kernel + torch's 8-bit GEMM + scales) against the reference's apply (devices/w8a8.py, the
formats' definition: max |err| / max |ref|) and, in time per call, against bf16 ``F.linear``.

Llama-3-8B's block linears at M = 1 .. 4096 rows. Each candidate runs over ~1 GB of weight copies inside one
CUDA graph, as a decode step reads its weights (none of them from L2), replayed until ~50 ms have passed.

    PYTHONPATH=. python3 benchmark/w8a8_gemm.py
    PYTHONPATH=. python3 benchmark/w8a8_gemm.py --m 1 256 --shapes qkv down
    PYTHONPATH=. python3 benchmark/w8a8_gemm.py --with-producer   # the op before the layer included
    PYTHONPATH=. python3 benchmark/w8a8_gemm.py --gated --m 128 256 512   # int8 gate|up with the activation

``--with-producer``: each layer with the op that makes its input in a decoder layer (q|k|v and gate|up: RMSNorm
with the residual add; down: silu(gate) * up), timed as bf16 (the float op, then F.linear), as the 8-bit layer
quantizing its own input (the float op, then apply) and with the quantization fused into that op (CudaOps'
rms_norm_quant / silu_and_mul_quant, then apply on the codes: what the engine runs, nn/feeds.py).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from bench_utils import SHAPES

import lmdeploy.devices.layers  # noqa: F401,E402  (before devices.w8a8, which it imports)
from lmdeploy.devices.w8a8 import W8A8Fp8Linear, W8A8Int8Linear, quantize_per_channel  # noqa: E402


def _layer(impl, w_q, w_scale):
    layer = nn.Module()
    impl.create_weights(layer, w_q.shape[1], w_q.shape[0], False)
    layer.weight.data, layer.weight_scale.data = w_q, w_scale
    impl.process_weights(layer)
    return layer


def time_us(fn, items, budget_s=0.05) -> float:
    """Microseconds of ``fn(item)`` per item, as replays of one CUDA graph over all ``items`` (eager with events
    where capture fails)."""
    def run():
        for it in items:
            fn(it)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm up (Triton compiles, cuBLAS picks) off the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        step = graph.replay
    except Exception as e:  # noqa: BLE001
        print(f'    (graph capture failed, timing eagerly: {type(e).__name__}: {str(e)[:100]})')
        torch.cuda.synchronize()
        step = run
    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    reps = int(min(200, max(3, budget_s / max(time.perf_counter() - t0, 1e-6))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(items))


def max_rel(got, want) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def producer_table(ops, impls_of, shapes, ms):
    """Each layer with the op before it: bf16, 8-bit unfused, 8-bit fused (see the module's docstring)."""
    head = (f"{'shape':>8} {'M':>5} | {'bf16':>8} | {'int8':>8} {'fused':>8} {'x bf16':>6} | "
            f"{'fp8':>8} {'fused':>8} {'x bf16':>6}")
    print('\nwith the op before the layer (us per call):')
    print(head)
    print('-' * len(head))
    dev = 'cuda'
    for name, n, k in shapes:
        if name not in ('qkv', 'gate_up', 'down'):
            continue
        w, bf16_ws, impls = impls_of(name, n, k)
        g = torch.Generator(device=dev).manual_seed(1)
        for m in ms:
            if name == 'down':  # silu(gate) * up of the gate|up projection's output
                gu = torch.randn(m, 2 * k, device=dev, generator=g, dtype=torch.bfloat16)
                def float_op():
                    return ops.silu_and_mul(gu)
                def fused_op(fp8):
                    return ops.silu_and_mul_quant(gu, fp8)
            else:  # RMSNorm with the residual add
                x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
                res = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
                nw = torch.rand(k, device=dev, generator=g).to(torch.bfloat16) + 0.5
                def float_op():
                    return ops.rms_norm(x, nw, 1e-5, res)[0]
                def fused_op(fp8):
                    return ops.rms_norm_quant(x, nw, 1e-5, res, fp8)[0]
            row = f'{name:>8} {m:>5} |'
            t_bf16 = time_us(lambda wt: F.linear(float_op(), wt), bf16_ws)
            row += f' {t_bf16:8.1f} |'
            for fmt in ('int8', 'fp8'):
                impl, _, layers = impls.get(fmt, (None, None, None))
                if impl is None or not layers[0].w8a8_fast:
                    row += f" {'-':>8} {'-':>8} {'-':>6} |"
                    continue
                fp8 = fmt == 'fp8'
                # rows whose output differs: the fused norm sums a row's squares in its own order (a rare row's
                # codes a step apart: kernels/w8a8_quant.py)
                apart = int((impl.apply(layers[0], float_op()) != impl.apply(layers[0], fused_op(fp8))).any(-1).sum())
                t_plain = time_us(lambda layer: impl.apply(layer, float_op()), layers)
                t_fused = time_us(lambda layer: impl.apply(layer, fused_op(fp8)), layers)
                row += f' {t_plain:8.1f} {t_fused:8.1f} {t_bf16 / t_fused:6.2f}{f" ({apart} rows apart)" if apart else ""} |'
            print(row.rstrip(' |'), flush=True)
        del w, bf16_ws, impls
        torch.cuda.empty_cache()


def int8_sweep(impls_of, shapes, ms, top: int):
    """The fused int8 GEMM's tiles (kernels/w8a8_gemm.py), codes already made: the fastest per layer and M
    against choose()'s and bf16's."""
    import itertools

    from lmdeploy.devices.cuda.kernels import w8a8_gemm
    from lmdeploy.devices.cuda.kernels.limits import shared_memory
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    smem = shared_memory(torch.device('cuda', torch.cuda.current_device()))
    configs = [c for c in itertools.product((64, 128), (64, 128, 256), (64, 128, 256), (4, 8), (3, 4, 5))
               if (c[0] + c[1]) * c[2] * c[4] <= 200 * 1024 and not (c[0] == 128 and c[1] == 256 and c[3] == 4)]
    print(f'\nint8 GEMM tiles, {len(configs)} configs (BM, BN, BK, warps, stages); us per call:')
    for name, n, k in shapes:
        w, bf16_ws, impls = impls_of(name, n, k)
        layers = impls['int8'][2]
        g = torch.Generator(device='cuda').manual_seed(3)
        for m in ms:
            q = torch.randint(-127, 128, (m, k), device='cuda', dtype=torch.int8, generator=g)
            sa = torch.rand(m, 1, device='cuda', generator=g)
            x = torch.randn(m, k, device='cuda', generator=g, dtype=torch.bfloat16)
            t_bf16 = time_us(lambda wt: F.linear(x, wt), bf16_ws)

            def gemm(layer, cfg, tma=None):
                return w8a8_gemm.int8_gemm_scaled(q, layer.weight, sa, layer.weight_scale, None, torch.bfloat16,
                                                  config=cfg, num_sms=sms, tma=tma)
            want = gemm(layers[0], None)
            t_now = time_us(lambda layer: gemm(layer, None), layers)
            results = []
            # each tile read through pointers and, on Hopper, through TMA descriptors (the default there)
            for cfg, tma in itertools.product(configs, (False, True) if w8a8_gemm.tma_ok(q, layers[0].weight) else
                                              (False, )):
                label = cfg + (('tma', ) if tma else ())
                try:
                    if not torch.equal(gemm(layers[0], cfg, tma), want):
                        results.append((float('inf'), label, 'DIFFERS'))
                        continue
                    results.append((time_us(lambda layer: gemm(layer, cfg, tma), layers, budget_s=0.02), label, ''))
                except Exception as e:  # noqa: BLE001
                    results.append((float('inf'), label, type(e).__name__))
            results.sort(key=lambda r: r[0])
            best = ', '.join(f'{c} {t:.1f}{" " + why if why else ""}' for t, c, why in results[:top])
            print(f'{name:>8} M={m:>5}: bf16 {t_bf16:.1f}, choose() {w8a8_gemm.choose(m, n, k, sms, smem)} {t_now:.1f}; best: {best}',
                  flush=True)
        del w, bf16_ws, impls
        torch.cuda.empty_cache()


# tiles of the whole [M, 2I] GEMM the gated table also tries (BM, BN, BK, warps, stages)
GATED_TILES = ((128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 128, 4, 4),
               (64, 128, 128, 4, 4), (64, 256, 64, 4, 4), (128, 256, 128, 8, 2))


def gated_table(ops, impls_of, ms):
    """int8 gate|up with silu(gate) * up and the quantization for down, codes of the norm already made: bf16 (its
    GEMM and activation), the int8 GEMM then silu_and_mul_quant, and the gated GEMM (what the engine runs on sm80
    on) with choose()'s tile and the best of GATED_TILES (its codes checked equal)."""
    from lmdeploy.devices.cuda.kernels import w8a8_gemm, w8a8_quant
    from lmdeploy.devices.layers import LinearImpl
    name, n, k = next(s for s in SHAPES if s[0] == 'gate_up')
    w, bf16_ws, impls = impls_of(name, n, k)
    impl, _, layers = impls['int8']
    head = f"{'M':>5} | {'bf16':>8} | {'int8':>8} {'gated':>8} {'x bf16':>6} | best tile"
    print('\nint8 gate|up, silu(gate) * up and its quantization (us per call):')
    print(head)
    print('-' * len(head))
    g = torch.Generator(device='cuda').manual_seed(4)
    for m in ms:
        x = torch.randn(m, k, device='cuda', generator=g, dtype=torch.bfloat16)
        t_bf16 = time_us(lambda wt: ops.linear_silu_and_mul(x, wt, None), bf16_ws)
        qi = ops.quantize_per_token(x, False)

        def unfused(layer):
            return LinearImpl.apply_silu_and_mul_quant(impl, layer, qi, False)

        def gated(layer, cfg=None):
            act, amax = w8a8_gemm.gated_gemm_scaled(qi.q, layer.weight, qi.scale, layer.weight_scale, None,
                                                    torch.bfloat16, rows=m, config=cfg)
            return w8a8_quant.quantize_with_amax(act, amax, False)[0]
        want = unfused(layers[0]).q[:m]
        assert torch.equal(impl.apply_silu_and_mul_quant(layers[0], qi, False).q[:m], want), 'codes differ'
        t_plain, t_gated = time_us(unfused, layers), time_us(lambda layer: impl.apply_silu_and_mul_quant(
            layer, qi, False), layers)
        tries = []
        for cfg in GATED_TILES:
            try:
                ok = torch.equal(gated(layers[0], cfg)[:m], want)
                tries.append((time_us(lambda layer: gated(layer, cfg), layers, budget_s=0.02) if ok else float('inf'),
                              cfg))
            except Exception:  # noqa: BLE001
                tries.append((float('inf'), cfg))
        t_best, cfg_best = min(tries)
        print(f'{m:>5} | {t_bf16:8.1f} | {t_plain:8.1f} {t_gated:8.1f} {t_bf16 / t_gated:6.2f} | {cfg_best} {t_best:.1f}',
              flush=True)
    del w, bf16_ws, impls
    torch.cuda.empty_cache()


def main():
    from lmdeploy.devices.cuda.ops import CudaOps
    from lmdeploy.devices.cuda.w8a8 import CudaW8A8Fp8Linear, CudaW8A8Int8Linear
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--m', type=int, nargs='+', default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument('--shapes', nargs='+', default=['qkv', 'o', 'gate_up', 'down'])
    parser.add_argument('--weight-mb', type=int, default=1024, help='bytes of weight copies walked per replay')
    parser.add_argument('--with-producer', action='store_true',
                        help='only the table of each layer with the op before it, unfused and fused')
    parser.add_argument('--int8-sweep', type=int, default=0, metavar='TOP',
                        help="only the int8 GEMM's tile sweep, the TOP fastest per layer and M")
    parser.add_argument('--gated', action='store_true',
                        help='only the table of int8 gate|up with silu(gate) * up and its quantization')
    args = parser.parse_args()
    ops = CudaOps()
    cap = torch.cuda.get_device_capability()
    print(f'{torch.cuda.get_device_name()} (sm{cap[0]}{cap[1]}), torch {torch.__version__}')
    t_start = time.time()
    dev = 'cuda'

    def impls_of(name, n, k):
        """(bf16 weight, its copies, {fmt: (impl, reference impl, layers over the weight's copies)})."""
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) / k**0.5
        copies = max(1, (args.weight_mb << 20) // (n * k))
        bf16_ws = [w.clone() for _ in range(max(1, copies // 2))]
        impls = {}
        for fmt, cls, ref_cls in (('int8', CudaW8A8Int8Linear, W8A8Int8Linear),
                                  ('fp8', CudaW8A8Fp8Linear, W8A8Fp8Linear)):
            try:
                w_q, w_s = quantize_per_channel(w, fmt == 'fp8')
                impl, ref = cls(ops), ref_cls(ops)
                layers = [_layer(impl, w_q.clone(), w_s.clone()) for _ in range(copies)]
                impls[fmt] = (impl, ref, layers)
            except Exception as e:  # noqa: BLE001
                print(f'{name}: {fmt} weights failed: {type(e).__name__}: {e}')
        return w, bf16_ws, impls

    shapes = [s for s in SHAPES if s[0] in args.shapes]
    if args.int8_sweep:
        int8_sweep(impls_of, shapes, args.m, args.int8_sweep)
        print(f'done in {time.time() - t_start:.0f} s')
        return
    if args.gated:
        gated_table(ops, impls_of, args.m)
        print(f'done in {time.time() - t_start:.0f} s')
        return
    if args.with_producer:
        producer_table(ops, impls_of, shapes, args.m)
        print(f'done in {time.time() - t_start:.0f} s')
        return
    print('us per call (CUDA graph replays over weight copies); err: max |impl - reference| / max |reference|')
    head = (f"{'shape':>8} {'N':>6} {'K':>6} {'M':>5} | {'bf16':>8} | {'int8':>8} {'x bf16':>6} {'err':>8} | "
            f"{'fp8':>8} {'x bf16':>6} {'err':>8}")
    print(head)
    print('-' * len(head))
    for name, n, k in shapes:
        w, bf16_ws, impls = impls_of(name, n, k)
        g = torch.Generator(device=dev).manual_seed(2)
        for m in args.m:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            row = f'{name:>8} {n:>6} {k:>6} {m:>5} |'
            try:
                t_bf16 = time_us(lambda wt: F.linear(x, wt), bf16_ws)
                row += f' {t_bf16:8.1f} |'
            except Exception as e:  # noqa: BLE001
                t_bf16 = float('nan')
                row += f" {'failed':>8} |"
                print(f'    bf16 {name} M={m}: {type(e).__name__}: {str(e)[:200]}')
            for fmt in ('int8', 'fp8'):
                if fmt not in impls:
                    row += f" {'-':>8} {'-':>6} {'-':>8} |"
                    continue
                impl, ref, layers = impls[fmt]
                try:
                    if not layers[0].w8a8_fast:
                        row += f" {'ref':>8} {'-':>6} {'-':>8} |"  # (fp8 below sm89: the reference runs)
                        continue
                    err = max_rel(impl.apply(layers[0], x), ref.apply(layers[0], x))
                    t = time_us(lambda layer: impl.apply(layer, x), layers)
                    row += f' {t:8.1f} {t_bf16 / t:6.2f} {err:8.1e} |'
                except Exception as e:  # noqa: BLE001
                    row += f" {'failed':>8} {'-':>6} {'-':>8} |"
                    print(f'    {fmt} {name} M={m}: {type(e).__name__}: {str(e)[:200]}')
            print(row.rstrip(' |'), flush=True)
        fp8 = impls.get('fp8')
        if fp8 is not None and fp8[0]._rowwise:
            paths = {str(key[1]): 'row-wise _scaled_mm' if ok else 'unit-scaled _scaled_mm + epilogue'
                     for key, ok in fp8[0]._rowwise.items()}
            print(f'    fp8 GEMM path: {paths}')
        del impls, bf16_ws, w
        torch.cuda.empty_cache()
    print(f'done in {time.time() - t_start:.0f} s')


if __name__ == '__main__':
    main()
