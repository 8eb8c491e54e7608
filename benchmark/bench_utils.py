"""What the benchmarks share: the Llama-3-8B GEMM shapes, the relative error
every candidate is checked with, timing over a model's worth of weights, and
an engine with its model taken out (to time or record the host's part) with
a batch of requests run through it."""
from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional, Sequence

import torch

# (name, N, K) of a Llama-3-8B block, and its logits
SHAPES = [('qkv', 6144, 4096), ('o', 4096, 4096), ('gate_up', 28672, 4096), ('down', 4096, 14336),
          ('lm_head', 128256, 4096)]


def block_gemm_flops_per_token(cfg) -> int:
    """FLOPs of one token through every layer's projections (q, k, v, o, gate, up, down; not the LM head)."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return 2 * cfg.num_layers * d * (q + 2 * kv + q + 3 * cfg.intermediate_size)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def weight_copies(n: int, k: int, dtype=torch.bfloat16) -> List[torch.Tensor]:
    """~2 GB of random [n, k] weights: a replay that walks them all reads each
    from memory, as a decode step does (L2 holds none of them)."""
    return [torch.randn(n, k, device='cuda', dtype=dtype) / k**0.5 for _ in range(max(1, (2 << 30) // (n * k * 2)))]


def us_per_weight(fn: Callable[[torch.Tensor], object], ws: List[torch.Tensor]) -> float:
    """Microseconds of ``fn(w)`` for one weight, timed as CUDA graph replays over all of ``ws``."""
    from triton.testing import do_bench_cudagraph
    return 1e3 * do_bench_cudagraph(lambda: [fn(w) for w in ws]) / len(ws)


def random_paged_cache(spec, lengths: Sequence[int], gen: Optional[torch.Generator] = None, device='cuda'):
    """(cache, block tables) of ``spec`` (a KVCacheSpec) holding sequences of ``lengths`` tokens in blocks
    handed out in random order (as a busy cache hands them out), with random contents: codes over a
    byte's whole range, (scale, zero) pairs in the ranges a quantized cache holds, the rest normal."""
    need = [-(-n // spec.block_size) for n in lengths]
    cache = spec.allocate(sum(need), device)
    for t in cache.tensors().values():
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, device=device, dtype=torch.int32))
        elif t.shape[-1] == 2 and cache.quant_policy:  # (scale, zero)
            t[..., 0].uniform_(0.001, 0.05, generator=gen)
            t[..., 1].uniform_(-2, 0, generator=gen)
        else:
            t.normal_(generator=gen)
    perm = torch.randperm(sum(need), generator=gen, device=device).to(torch.int32)
    tables = torch.zeros(len(lengths), max(need), dtype=torch.int32, device=device)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at:at + n]
        at += n
    return cache, tables


def stub_model(engine, max_rows: int):
    """Take the model out of a cpu engine: a step's forward returns an empty hidden state, its logits a few
    columns and its greedy pick token 0 (they cost nothing), so what runs is the host's part alone."""
    hidden = engine.model_config.hidden_size
    engine.runner._eager_forward = lambda ids, positions, ctx: torch.empty(ids.shape[0], hidden)
    top = torch.zeros(max_rows, 8)
    engine.runner.logits = lambda h, rows=None: top[:h.shape[0]]
    engine.runner.greedy = lambda h, rows=None: torch.zeros(h.shape[0], dtype=torch.int64)


def run_requests(engine, prompts: Sequence[List[int]], outs: Sequence[int], stream: bool = False,
                 arrivals: Optional[Sequence[float]] = None):
    """Greedy requests of ``outs[i]`` tokens, submitted as Pipeline.infer submits a batch (longest output
    first; ``stream=False``: one output at the end) and waited for; or with ``arrivals`` (seconds from the
    call, one per request) request i submitted at arrivals[i], as a server receives them."""
    from lmdeploy.engine.engine import EngineRequest
    from lmdeploy.engine.sequence import SamplingParams
    left, done = [len(prompts)], threading.Event()

    def on_output(out):
        if out.finished:
            left[0] -= 1
            if not left[0]:
                done.set()

    order = sorted(range(len(outs)), key=lambda i: -outs[i]) if arrivals is None else range(len(outs))
    start = time.perf_counter()
    for i in order:
        if arrivals is not None:
            time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        engine.submit(EngineRequest(i + 1, prompts[i], SamplingParams(max_new_tokens=int(outs[i]), greedy=True),
                                    on_output, stream=stream))
    done.wait()
