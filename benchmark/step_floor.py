"""The throughput workload's floor on this GPU: its schedule, each step's kernels back to back.

A run's device time is its steps' kernels plus whatever keeps the GPU from running them back to back
(host work, launch gaps, clocks). This separates the two.

1. The workload (``throughput.make_workload``: same seed, same lengths as ``throughput.py``) runs through
   the real engine and scheduler on the cpu device with the model taken out (as host_overhead.py does),
   with the KV capacity of the GPU run, and every step is recorded: each sequence's tokens this step, its
   context, its KV blocks (on the H100 the step counts of one run exactly, of another within 6 steps: when
   a step may run ahead of the one in flight depends a little on timing). With ``--request-rate`` the
   requests arrive as a server receives them and each step takes a modelled device time (a serving
   schedule). Printed: the steps and the work they fix, GEMM FLOPs per phase and the KV bytes
   decode attention reads. Every generated token reads its whole context once, so the KV bytes are the
   same under any schedule; so are the GEMM rows (each token passes through the model once).
2. ``--measure`` (a CUDA GPU): one decoder layer of the model's shape, random weights, runs every
   recorded step with its real block tables: decode steps as graphs padded as the engine pads them,
   prefill steps eagerly, as the engine runs them. 32 layers of that plus the step's own part (embedding,
   final norm, logits, greedy pick) is the step's floor; the layer's four GEMMs are timed alone at the
   same rows to split it. The sum is what the run would take if the GPU ran these kernels back to back.

    python benchmark/step_floor.py                                 # schedule and work (cpu, ~10 s)
    python benchmark/step_floor.py --measure --kv-tokens 312000    # + the floor on this GPU (~1 min)
    python benchmark/step_floor.py --num-requests 800 --request-rate 20      # a serving schedule (~45 s)
    python benchmark/step_floor.py --num-requests 300 --input-len 3000 --output-len 64 --sigma 0 \
        --max-input-len 4000                                       # the prefill-bound workload
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import tempfile
import time
import types
from typing import List, NamedTuple, Tuple

from bench_utils import block_gemm_flops_per_token, run_requests, stub_model
from random_model import SHAPES, make_config, make_model
from throughput import make_workload


class Row(NamedTuple):
    computed: int  # context tokens before this step
    new: int  # tokens this step
    total: int  # the sequence's tokens so far (prompt and generated)
    blocks: Tuple[int, ...]


class Step(NamedTuple):
    is_decode: bool
    rows: List[Row]

    @property
    def tokens(self) -> int:
        return sum(r.new for r in self.rows)

    @property
    def sampled(self) -> int:
        """Rows whose logits are taken: every sequence that finishes its pending tokens."""
        return sum(r.computed + r.new >= r.total for r in self.rows)

    def decode_context(self) -> int:
        """Context tokens the step's one-token rows attend over (their new token included)."""
        return sum(r.computed + 1 for r in self.rows if r.new == 1)


def stand_in_model(out: str, vocab_size: int, max_positions: int) -> str:
    """A one-layer model the stubbed engine loads: only its vocabulary and length limit matter."""
    return make_model('llama-small', out, dtype='float32', num_hidden_layers=1, hidden_size=64,
                      intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab_size,
                      max_position_embeddings=max_positions)


def engine_config(shape: str, out: str, **overrides):
    """lmdeploy's ModelConfig of a random_model.py shape (its config.json written to ``out``, no weights)."""
    from lmdeploy.engine.model_config import load_model_config
    config = make_config(shape, **overrides)
    config.architectures = [type(config).__name__.replace('Config', 'ForCausalLM')]
    config.save_pretrained(out)
    return load_model_config(out)


def record_schedule(model_dir: str, prompts: List[List[int]], outs: List[int], max_batch_size: int,
                    num_blocks: int, block_size: int, max_prefill_tokens: int, refill_slots: int = 0,
                    mix: bool = False, request_rate: float = 0.0, step_cost: Tuple[float, float] = (0.0, 0.0),
                    seed: int = 0) -> List[Step]:
    """Every step the engine runs for these requests, submitted as Pipeline.infer submits a batch, scheduled
    as a graph device schedules them (``refill_slots`` other than the scheduler's own), or with ``mix`` as an
    eager device does (prompts join every step).

    A serving schedule: ``request_rate`` > 0 submits the requests one by one at Poisson arrival times (req/s,
    seeded) instead, and each step takes the device time ``step_cost`` models, (ms a step, ms per 1,000 of
    its tokens) (the stubbed model sleeps that long), so which arrivals join which step follows the GPU's
    pace rather than the cpu's."""
    from lmdeploy.engine.engine import Engine
    from lmdeploy.messages import PytorchEngineConfig
    eng = Engine(model_dir, PytorchEngineConfig(device_type='cpu', max_batch_size=max_batch_size,
                                                num_gpu_blocks=num_blocks, block_size=block_size,
                                                max_prefill_token_num=max_prefill_tokens))
    eng.scheduler.mix = mix
    if refill_slots:
        eng.scheduler.refill_slots = refill_slots
    stub_model(eng, max_batch_size)
    steps: List[Step] = []
    run_step = eng._run_step

    def recorded(batch):
        step = Step(batch.is_decode, [Row(s.num_computed, n, s.num_tokens, tuple(s.block_ids))
                                      for s, n in zip(batch.seqs, batch.num_new_tokens)])
        steps.append(step)
        if step_cost != (0.0, 0.0):
            time.sleep((step_cost[0] + step_cost[1] * step.tokens / 1000) / 1000)
        run_step(batch)

    eng._run_step = recorded
    if request_rate > 0:
        rng = random.Random(seed)
        arrivals = list(itertools.accumulate(rng.expovariate(request_rate) for _ in prompts))
        run_requests(eng, prompts, outs, arrivals=arrivals)
    else:
        run_requests(eng, prompts, outs)
    eng.close()
    return steps


def work(steps: List[Step], cfg) -> dict:
    """What the schedule fixes, per phase: steps, rows, GEMM TFLOP, decode-attention KV TB."""
    d, hkv, hd, L = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    per_row = block_gemm_flops_per_token(cfg)
    kv_per_token = 2 * L * hkv * hd * 2  # K and V, bf16
    out = {}
    for phase, is_decode in (('prefill', False), ('decode', True)):
        ss = [s for s in steps if s.is_decode == is_decode]
        rows = sum(s.tokens for s in ss)
        sampled = sum(s.sampled for s in ss)
        out[phase] = dict(steps=len(ss), rows=rows, sampled=sampled,
                          tflop=(rows * per_row + sampled * 2 * d * cfg.vocab_size) / 1e12,
                          kv_tb=sum(s.decode_context() for s in ss) * kv_per_token / 1e12)
    return out


# ------------------------------------------------------------------------------------------------ GPU part
def _fake_batch(step: Step):
    """The step as ModelRunner.build_inputs reads it."""
    from lmdeploy.engine.scheduler import ScheduledBatch

    class Ids:  # token ids: their values do not change a kernel's time

        def __getitem__(self, i):
            return [1] * len(range(*i.indices(1 << 30))) if isinstance(i, slice) else 1

    seqs = [types.SimpleNamespace(token_ids=Ids(), num_computed=r.computed, block_ids=list(r.blocks),
                                  num_tokens=r.total) for r in step.rows]
    return ScheduledBatch(seqs, [r.new for r in step.rows])


def measure(steps: List[Step], cfg, num_blocks: int, block_size: int, session_len: int, max_batch_size: int,
            device_type: str = 'cuda', reps: int = 3) -> List[Tuple[float, float]]:
    """Per step: seconds of (its layers and its own part, the block GEMMs of its layers) on the device."""
    import dataclasses

    import torch

    from lmdeploy.devices import get_device
    from lmdeploy.devices.cache import KVCache, standard_spec
    from lmdeploy.devices.runtime import GRAPHS_STEPS
    from lmdeploy.engine.graph_runner import GraphRunner
    from lmdeploy.engine.plan import RankPlan
    from lmdeploy.engine.model_runner import ModelRunner
    from lmdeploy.engine.models import get_model_class
    from lmdeploy.engine.nn.build import building
    ops = device = get_device(device_type)
    dev = device.torch_device()
    dtype = torch.bfloat16 if device_type == 'cuda' else torch.float32
    torch.manual_seed(0)
    with torch.device(dev), building(device):
        model = get_model_class(cfg)(dataclasses.replace(cfg, num_layers=1)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # O(1) activations, as random_model.py draws them
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0, 1.0 if 'embed' in name else p.shape[-1]**-0.5)
    layer, body = model.model.layers[0], model.model
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [KVCache(torch.randn(shape, dtype=dtype, device=dev), torch.randn(shape, dtype=dtype, device=dev))]
    runner = types.SimpleNamespace(block_size=block_size, torch_device=dev, kv_caches=caches)
    runner.pack_inputs = types.MethodType(ModelRunner.pack_inputs, runner)
    runner.unpack_inputs = types.MethodType(ModelRunner.unpack_inputs, runner)
    most = max(max_batch_size, max(s.tokens for s in steps))
    x = torch.randn(most, cfg.hidden_size, dtype=dtype, device=dev)
    res = torch.randn_like(x)
    wide = torch.randn(most, cfg.intermediate_size, dtype=dtype, device=dev)
    cos = torch.rand(most, cfg.head_dim, dtype=dtype, device=dev)
    sin = torch.rand_like(cos)
    attn, mlp = layer.self_attn, layer.mlp
    gemms = [(x, attn.qkv_proj.weight), (x, attn.o_proj.weight), (x, mlp.gate_up_proj.weight),
             (wide, mlp.down_proj.weight)]

    def one_layer(ids, positions, ctx):
        n = ids.shape[0]
        return layer(x[:n], res[:n], cos[:n], sin[:n], ctx)[0]

    runtime = device.runtime
    graphs = None
    if runtime.plan.graphs == GRAPHS_STEPS:  # decode steps replay graphs, padded as the engine pads them
        spec = standard_spec(cfg.num_kv_heads, cfg.head_dim, block_size, dtype)  # the caches' layout
        plan = RankPlan(spec, num_blocks, session_len, max_batch_size, max_batch_size, max_mixed_tokens=0,
                        dtype=dtype, graphs=GRAPHS_STEPS, records_mixed_steps=False, profile_memory=False,
                        memory_is_host_ram=False)
        graphs = GraphRunner(runtime, one_layer, caches, plan)

    def timed(fn) -> float:
        fn()
        start = runtime.timestamp()
        for _ in range(reps):
            fn()
        end = runtime.timestamp()
        runtime.synchronize()
        return runtime.seconds_between(start, end) / reps

    def step_part(ids, positions, ctx, sampled):
        """Once a step: embedding, rotary angles, final norm, logits of the sampled rows, greedy pick."""
        h = body.embed_tokens(ids)
        body.rotary_emb.cos_sin(positions, ctx.rope_lens)
        h, _ = body.norm(h, res[:ids.shape[0]])
        ops.argmax(model.compute_logits(h[:sampled]))

    results = []
    with torch.inference_mode():
        for step in steps:
            ids, positions, ctx = ModelRunner.build_inputs(runner, _fake_batch(step))
            rows = ids.shape[0]
            if graphs is not None and step.is_decode:
                graphs(ids, positions, ctx)  # records the padded size's graph on first use
                rows = next(n for n in graphs.sizes if n >= rows)
                t_layer = timed(graphs.graphs[('decode', rows)][0])
            else:
                t_layer = timed(lambda: one_layer(ids, positions, ctx))
            t_gemm = timed(lambda: [ops.linear(a[:rows], w) for a, w in gemms])
            t_step = timed(lambda: step_part(ids, positions, ctx, step.sampled))
            results.append((cfg.num_layers * t_layer + t_step, cfg.num_layers * t_gemm))
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--shape', default='llama3-8b', help="random_model.py's shape whose config is used")
    p.add_argument('--num-requests', type=int, default=2000)
    p.add_argument('--input-len', type=int, default=150)
    p.add_argument('--output-len', type=int, default=140)
    p.add_argument('--sigma', type=float, default=0.9)
    p.add_argument('--max-input-len', type=int, default=2000)
    p.add_argument('--max-output-len', type=int, default=1000)
    p.add_argument('--max-batch-size', type=int, default=256)
    p.add_argument('--max-prefill-token-num', type=int, default=8192)
    p.add_argument('--kv-tokens', type=int, default=312000, help="the GPU run's KV capacity (throughput.py prints it)")
    p.add_argument('--block-size', type=int, default=64)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--refill-slots', type=int, default=0, help="free slots that call for a prefill step "
                   "(default: the scheduler's)")
    p.add_argument('--mix', action='store_true', help='prompts join every step, as on an eager device (what '
                   'the floor of such a schedule is; the engine replays graphs only for decode-only steps)')
    p.add_argument('--request-rate', type=float, default=0.0, help='a serving schedule: requests arrive one by '
                   'one at this Poisson rate (req/s) instead of all at once (see --step-cost)')
    p.add_argument('--step-cost', type=float, nargs=2, default=(8.0, 26.0), metavar=('MS', 'MS_PER_1K'),
                   help='with --request-rate: the device time a step takes, ms plus ms per 1,000 of its tokens '
                   '(default: an H100 on the Llama-3-8B shape, a decode step ~8 ms, prompt tokens ~26 us each)')
    p.add_argument('--measure', action='store_true', help='time every step on the device')
    p.add_argument('--device', default='cuda', help='where --measure times the steps')
    p.add_argument('--max-steps', type=int, default=None, help='time only the first steps (a check)')
    args = p.parse_args()

    shape = SHAPES[args.shape]
    wl = types.SimpleNamespace(seed=args.seed, num_requests=args.num_requests, input_len=args.input_len,
                               output_len=args.output_len, input_sigma=args.sigma, output_sigma=args.sigma,
                               max_input_len=args.max_input_len, max_output_len=args.max_output_len)
    prompts, outs = make_workload(wl, shape['vocab_size'])
    with tempfile.TemporaryDirectory() as tmp:
        stand_in = stand_in_model(os.path.join(tmp, 'stand-in'), shape['vocab_size'], shape['max_position_embeddings'])
        steps = record_schedule(stand_in, prompts, outs, args.max_batch_size, -(-args.kv_tokens // args.block_size),
                                args.block_size, args.max_prefill_token_num, args.refill_slots, args.mix,
                                args.request_rate, tuple(args.step_cost) if args.request_rate > 0 else (0.0, 0.0),
                                args.seed)
        cfg = engine_config(args.shape, os.path.join(tmp, 'config'))
    generated = sum(outs)
    print(f'{args.num_requests} requests, {sum(map(len, prompts))} prompt and {generated} output tokens, '
          f'{cfg.num_layers} layers of the {args.shape} shape, KV for {args.kv_tokens} tokens' +
          (f', arriving at {args.request_rate:g} req/s (steps of {args.step_cost[0]:g} ms + '
           f'{args.step_cost[1]:g} ms per 1,000 tokens)' if args.request_rate > 0 else ', all at once'))
    for phase, w in work(steps, cfg).items():
        print(f"  {phase}: {w['steps']} steps, {w['rows'] / max(1, w['steps']):.1f} rows/step, "
              f"{w['tflop']:,.1f} TFLOP of GEMMs, decode attention reads {w['kv_tb']:.2f} TB of KV")
    if not args.measure:
        return
    steps = steps[:args.max_steps]
    per_step = measure(steps, cfg, -(-args.kv_tokens // args.block_size), args.block_size,
                       shape['max_position_embeddings'], args.max_batch_size, args.device)
    floors = {}
    for phase, is_decode in (('prefill', False), ('decode', True)):
        got = [r for s, r in zip(steps, per_step) if s.is_decode == is_decode]
        total, gemm = sum(t for t, _ in got), sum(g for _, g in got)
        floors[phase] = total
        print(f'  floor of the {phase} steps: {total:.2f} s ({1e3 * total / max(1, len(got)):.2f} ms/step), '
              f'of which the block GEMMs {gemm:.2f} s')
    floor = sum(floors.values())
    if args.max_steps is None:
        print(f'floor of the run: {floor:.2f} s of kernels back to back -> at most {generated / floor:,.0f} '
              'output tok/s')


if __name__ == '__main__':
    main()
