"""Steps with prompt rows replayed in pieces (engine/piecewise.py), on a CPU
stand-in for graphs (tests/graph_emulation.py, itself checked here): the
dense parts replay from recordings at a padded token count, attention runs
live between them, and the tokens equal transformers' whatever the mix."""
import random

import pytest
import torch
from engine_utils import assert_engine_clean, submit
from graph_emulation import PieceRecordingCpu, Tape
from helpers import hf_greedy

import lmdeploy.engine.engine as engine_module
from lmdeploy.engine.engine import Engine
from lmdeploy.engine.piecewise import PiecewiseRunner
from lmdeploy.engine.sequence import SamplingParams
from lmdeploy.messages import PytorchEngineConfig


def test_the_emulation_replays_recorded_work_on_new_inputs():
    x, w, buf = torch.randn(5, 3), torch.randn(4, 3), torch.zeros(5, 4)
    tape = Tape()
    with tape:
        y = torch.nn.functional.linear(x, w).relu()
        buf[:3].copy_(y[:3])
        z = y.split([1, 3], dim=1)[1].reshape(-1)
    x.copy_(torch.randn(5, 3))
    tape.replay()
    ref = torch.nn.functional.linear(x, w).relu()
    assert torch.equal(y, ref) and torch.equal(buf[:3], ref[:3]) and torch.equal(z, ref[:, 1:].reshape(-1))
    assert torch.equal(buf[3:], torch.zeros(2, 4))  # only what was recorded is written


@pytest.fixture
def recording(monkeypatch):
    device = PieceRecordingCpu()
    monkeypatch.setattr(engine_module, 'get_device', lambda device_type='auto': device)
    return device


@pytest.mark.parametrize('name', ['llama', 'qwen3'])
def test_mixed_steps_in_pieces_give_transformers_tokens(tiny_model_factory, recording, monkeypatch, name):
    """Requests arrive while others decode, so steps mix prompt chunks (chunked at 24 tokens) with
    one-token rows, at token counts between the buckets."""
    model = tiny_model_factory(name)
    seen = []  # (tokens, one-token rows) of each step replayed in pieces
    call = PiecewiseRunner.__call__

    def spy(self, input_ids, positions, ctx):
        seen.append((input_ids.shape[0], ctx.num_decode))
        return call(self, input_ids, positions, ctx)
    monkeypatch.setattr(PiecewiseRunner, '__call__', spy)
    eng = Engine(model, PytorchEngineConfig(device_type='cpu', block_size=4, session_len=160, max_batch_size=6,
                                            max_prefill_token_num=24, num_gpu_blocks=512))
    try:
        runner = eng.runner.pieces
        assert runner is not None and runner.sizes == [16, 30]  # 24 prompt tokens + 6 one-token rows
        rng = random.Random()
        prompts = [[rng.randrange(20, 1000) for _ in range(rng.randint(3, 40))] for _ in range(9)]
        limits = [rng.randint(3, 10) for _ in prompts]
        cols = []
        for p, n in zip(prompts, limits):
            cols.append(submit(eng, p, SamplingParams(max_new_tokens=n)))
            cols[0].done.wait(0.05)  # staggered arrivals
        got = [c.wait().token_ids for c in cols]
        assert_engine_clean(eng)
        stats = eng.stats().extra
    finally:
        eng.close()
    ref = hf_greedy(model, prompts, max(limits))
    assert got == [r[:n] for r, n in zip(ref, limits)]
    layers = len(runner.recordings[16].layers)
    assert layers == eng.model_config.num_layers
    # every step with prompt rows replayed its pieces (one more piece than layers)
    assert recording.piece_replays == stats['prefill_steps'] * (layers + 1) == len(seen) * (layers + 1)
    assert any(nd > 0 for _, nd in seen), seen  # decode rows rode along with prompt rows
    assert {t for t, _ in seen} - {16, 30}, seen  # and steps were padded to a bucket
