"""Requests a freshly built engine runs before it says it is ready.

Why: a device that compiles kernels on first use (Triton specializes a
kernel on its sizes: a count of 1, a multiple of 16, or neither) would
otherwise compile them while the first real requests wait: on an H100 the
first 800 requests after a start had a TTFT p99 of 7 s against 3 s for the
next 800. Recorded steps are captured before this runs; what is left is what
runs outside them: prompt steps past the largest recording, the sampling
variants, and the host-side code paths a serving load reaches. The requests
use random token ids and a few new tokens each, and leave nothing behind.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from typing import TYPE_CHECKING, List

from .sequence import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger('lmdeploy')

_TIMEOUT_S = 600.0
# the sampling a serving load asks for: greedy, temperature with each filter, penalties, logprobs, seeded
_SAMPLINGS = [
    dict(greedy=True),
    dict(greedy=False, temperature=0.7, top_p=0.9),
    dict(greedy=False, temperature=1.0, top_k=40, min_p=0.05),
    dict(greedy=False, temperature=0.8, top_k=20, top_p=0.8, repetition_penalty=1.1),
    dict(greedy=True, logprobs=5),
    dict(greedy=False, temperature=0.6, logprobs=2, repetition_penalty=1.05),
]


def prompt_lengths(engine: 'Engine') -> List[List[int]]:
    """Waves of prompt lengths, each wave run to the end before the next: long prompts alone (steps past the
    largest recording, a multiple of 16 tokens and not), then a burst of short ones (odd batch sizes, steps
    with prompt and decode rows together)."""
    longest = max(2, min(engine.config.max_prefill_token_num, engine.session_len - 8))
    limit = engine.runner.recorded_step_limit()
    waves = []
    if limit is not None and longest > limit[0]:
        waves.append([longest, max(limit[0] + 1, longest - 13)])
    short = max(2, min(longest, 100))
    waves.append([1 + (i * 37) % short for i in range(len(_SAMPLINGS) + 1)])  # batches of 7 down to 1
    return waves


def warm_up(engine: 'Engine'):
    """Run the waves through ``engine`` and wait for them; the engine's counters are reset after."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    start = time.perf_counter()
    session = -1
    for wave in prompt_lengths(engine):
        done, left, failed = threading.Event(), [len(wave)], []

        def on_output(out, left=left, done=done, failed=failed):
            if out.finished:
                if out.finish_reason == 'error':
                    failed.append(out.error)
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        from .engine import EngineRequest
        for i, n in enumerate(wave):
            params = SamplingParams(max_new_tokens=3 + i % 3, seed=i, **_SAMPLINGS[i % len(_SAMPLINGS)])
            engine.submit(EngineRequest(session, [rng.randrange(vocab) for _ in range(n)], params, on_output))
            session -= 1
        if not done.wait(_TIMEOUT_S):
            raise RuntimeError(f'the warm-up requests did not finish in {_TIMEOUT_S:.0f} s')
        if failed:
            raise RuntimeError(f'a warm-up request failed: {failed[0]}')
    engine.reset_counters()
    logger.info('warmed up in %.1f s', time.perf_counter() - start)
