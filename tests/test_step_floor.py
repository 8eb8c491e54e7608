"""benchmark/step_floor.py: the schedule it records is the engine's, and the
work it derives is what the workload fixes (whatever the schedule)."""
import random

from helpers import benchmark_module


def random_workload(seed, n, max_in, out_range):
    """n prompts of 4 to ``max_in`` random tokens and their output lengths."""
    rng = random.Random(seed)
    ins = [rng.randint(4, max_in) for _ in range(n)]
    outs = [rng.randint(*out_range) for _ in range(n)]
    return ins, outs, [[rng.randrange(100, 32000) for _ in range(k)] for k in ins]


def test_recorded_schedule_carries_every_token_once(tmp_path):
    sf = benchmark_module('step_floor')
    ins, outs, prompts = random_workload(7, 30, 90, (2, 40))
    model = sf.stand_in_model(str(tmp_path / 'stand-in'), 32000, 4096)
    steps = sf.record_schedule(model, prompts, outs, max_batch_size=8, num_blocks=200, block_size=16,
                               max_prefill_tokens=256)
    assert any(s.is_decode for s in steps) and any(not s.is_decode for s in steps)
    decode_rows = [r for s in steps for r in s.rows if r.new == 1]
    prompt_rows = [r for s in steps for r in s.rows if r.new > 1]
    # each prompt token computed once (chunks of at most the budget), each output token after the first decoded
    # once (the first comes from the prompt's last row), over the whole context so far
    assert sum(r.new for r in prompt_rows) == sum(ins)
    assert max(s.tokens for s in steps if not s.is_decode) <= 256 + 8
    assert len(decode_rows) == sum(outs) - len(outs)
    assert sum(s.decode_context() for s in steps) == sum((o - 1) * i + o * (o - 1) // 2 for i, o in zip(ins, outs))
    assert sum(s.sampled for s in steps) == sum(outs)
    assert all(len(r.blocks) * 16 >= r.computed + r.new for s in steps for r in s.rows)


def test_step_times_on_the_cpu_device(tmp_path):
    """The timing path (inputs built as the engine builds them, one layer per step) runs on any device."""
    sf = benchmark_module('step_floor')
    cfg = sf.engine_config('llama-small', str(tmp_path / 'cfg'), num_hidden_layers=2, hidden_size=128,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
    model = sf.stand_in_model(str(tmp_path / 'stand-in'), 500, 4096)
    steps = sf.record_schedule(model, [[120] * 40, [130] * 9, [140] * 17], [3, 5, 2], max_batch_size=4,
                               num_blocks=20, block_size=16, max_prefill_tokens=64)
    times = sf.measure(steps, cfg, num_blocks=20, block_size=16, session_len=4096, max_batch_size=4,
                       device_type='cpu', reps=1)
    assert len(times) == len(steps)
    assert all(0 < gemm < total for total, gemm in times)
    work = sf.work(steps, cfg)
    assert work['prefill']['rows'] + work['decode']['rows'] == 40 + 9 + 17 + (3 - 1) + (5 - 1) + (2 - 1)


def test_serving_schedule_takes_arrivals_as_they_come(tmp_path):
    """--request-rate: requests arrive one by one while steps take the modelled device time, so prompts
    join in small groups over more steps than when all arrive at once, and every token is still computed
    once."""
    sf = benchmark_module('step_floor')
    ins, outs, prompts = random_workload(3, 24, 60, (8, 30))
    model = sf.stand_in_model(str(tmp_path / 'stand-in'), 32000, 4096)
    steps = sf.record_schedule(model, prompts, outs, max_batch_size=16, num_blocks=400, block_size=16,
                               max_prefill_tokens=512, request_rate=200.0, step_cost=(2.0, 0.0), seed=1)
    prompt_steps = [s for s in steps if not s.is_decode]
    assert sum(r.new for s in steps for r in s.rows if r.new > 1) == sum(ins)  # (no prompt is chunked here)
    assert sum(s.sampled for s in steps) == sum(outs)
    # arrivals ~5 ms apart against 2 ms steps: prompts come a few at a time, not all in the first step
    assert len(prompt_steps) >= 6 and max(sum(r.new > 1 for r in s.rows) for s in prompt_steps) < len(prompts)
    all_at_once = sf.record_schedule(model, prompts, outs, max_batch_size=16, num_blocks=400, block_size=16,
                                     max_prefill_tokens=512)
    assert len([s for s in all_at_once if not s.is_decode]) < len(prompt_steps)
