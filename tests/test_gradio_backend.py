"""The chat page's local backend without a browser: refused input, an abandoned stream, no leaked blocks."""
from __future__ import annotations

import random

import pytest

from lmdeploy.serve.gradio.backend import ChatSession, ChatSettings


@pytest.fixture(scope='module')
def backend(smollm2_path):
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.serve.gradio.local import LocalBackend
    b = LocalBackend.from_model(smollm2_path, PytorchEngineConfig(device_type='cpu', session_len=256,
                                                                  num_gpu_blocks=16, block_size=16))
    yield b
    b.close()


def _clean(engine):
    assert engine.wait_idle(30)
    engine.check_invariants()
    s = engine.stats()
    assert s.num_running == 0 and s.num_idle_sessions == 0 and s.num_free_blocks == s.num_blocks, s


@pytest.mark.parametrize('bad', [dict(max_new_tokens=0), dict(temperature=-0.5), dict(top_p=0.0),
                                 dict(top_p=1.5)])
def test_bad_settings_are_refused_before_the_engine(backend, bad):
    session = ChatSession()
    with pytest.raises(ValueError):
        list(backend.stream(session, 'hello', ChatSettings(**bad)))
    assert session.session_id is None and not session.generating
    _clean(backend.engine)


def test_too_long_message_is_refused_and_forgotten(backend):
    session = ChatSession()
    words = ' '.join(random.choice(['apple', 'river', 'stone', 'cloud']) for _ in range(400))
    assert list(backend.stream(session, words, ChatSettings(max_new_tokens=8))) == []
    assert 'session_len' in (session.error or '') and session.session_id is None and session.turns == 0
    _clean(backend.engine)


def test_abandoned_stream_stops_the_engine(backend):
    session = ChatSession()
    turn = backend.stream(session, 'Write a long poem about the sea.', ChatSettings(max_new_tokens=200,
                                                                                     temperature=0))
    assert next(turn)
    turn.close()  # the page went away mid-answer
    assert backend.engine.wait_idle(5) and backend.engine.stats().num_running == 0
    assert session.finish_reason == 'abort' and session.generated_tokens < 200 and session.turns == 1
    assert backend.engine.stats().num_idle_sessions == 1  # kept for the next turn, until reset
    backend.reset(session)
    _clean(backend.engine)
    backend.stop(session)  # nothing to stop or free: harmless
    backend.reset(session)


def test_system_prompt_opens_the_conversation_only(backend):
    session = ChatSession()
    system = f'You are a careful assistant number {random.randrange(1000, 9999)}.'
    settings = ChatSettings(max_new_tokens=4, temperature=0, system_prompt=system)
    list(backend.stream(session, 'Hi.', settings))
    list(backend.stream(session, 'Bye.', settings))
    assert backend.engine.wait_idle(10)
    text = backend.pipeline.tokenizer.decode(backend.engine.scheduler.idle[session.session_id].token_ids)
    assert text.count(system) == 1 and text.index(system) < text.index('Hi.') < text.index('Bye.'), text
    backend.reset(session)
    _clean(backend.engine)
