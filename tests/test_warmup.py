"""The start-up warm-up (engine/warmup.py): it runs long prompts alone past the largest recorded step, then a
burst of short prompts with every sampling kind, and leaves the engine as it found it: no block held, every
counter at zero, and the next request's tokens the same as without a warm-up."""
import random

from engine_utils import assert_engine_clean, greedy, submit

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.warmup import prompt_lengths, warm_up
from lmdeploy.messages import PytorchEngineConfig


def _engine(path, warmup):
    return Engine(path, PytorchEngineConfig(device_type='cpu', session_len=512, max_batch_size=8,
                                            max_prefill_token_num=300, num_gpu_blocks=64, block_size=16,
                                            warmup=warmup))


def test_warm_up_leaves_nothing_behind(tiny_model_factory):
    path = tiny_model_factory('llama')
    prompt = [random.randrange(1, 200) for _ in range(random.randint(5, 40))]
    engine = _engine(path, warmup=False)
    try:
        want = submit(engine, prompt, greedy(6)).wait().token_ids
        engine.reset_counters()
        # as on a device that records steps of up to 64 tokens and 4 prompts
        engine.runner.recorded_step_limit = lambda: (64, 4)
        waves = prompt_lengths(engine)
        assert waves[0] == [300, 287]  # alone, past the recording: the budget, and not a multiple of 16
        assert len(waves[1]) == 7 and len(set(waves[1])) == 7 and max(waves[1]) <= 100
        warm_up(engine)
        assert_engine_clean(engine)
        stats = engine.stats()
        assert stats.num_generated_tokens == 0 and stats.extra['prefill_steps'] == 0
        assert stats.extra['decode_steps'] == 0 and stats.num_preemptions == 0
        assert submit(engine, prompt, greedy(6)).wait().token_ids == want
    finally:
        engine.close()


def test_warmup_config_runs_it_at_start(tiny_model_factory, caplog):
    caplog.set_level('INFO', logger='lmdeploy')
    engine = _engine(tiny_model_factory('llama'), warmup=True)
    try:
        assert any('warmed up' in r.getMessage() for r in caplog.records)
        assert_engine_clean(engine)
        assert engine.stats().num_generated_tokens == 0
    finally:
        engine.close()
    caplog.clear()
    off = _engine(tiny_model_factory('llama'), warmup=None)  # cpu: nothing to compile, no warm-up
    try:
        assert not any('warmed up' in r.getMessage() for r in caplog.records)
    finally:
        off.close()
