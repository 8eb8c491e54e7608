"""Prometheus metrics of the API server (``GET /metrics``).

Each app has its own :class:`prometheus_client.CollectorRegistry`, so several
servers in one process do not collide. Engine state (requests running and
waiting, KV blocks, generated tokens) is read from ``Engine.stats()`` at scrape
time; latencies are observed by the server as outputs stream out.

Names:

==========================================  =========  ===================================================
lmdeploy_num_requests_running               gauge      sequences the engine is running
lmdeploy_num_requests_waiting               gauge      sequences queued in the engine
lmdeploy_num_idle_sessions                  gauge      interactive sessions holding a cache between turns
lmdeploy_kv_cache_blocks_total              gauge      KV cache blocks
lmdeploy_kv_cache_blocks_free               gauge      free KV blocks (prefix-cached ones included)
lmdeploy_kv_cache_blocks_used               gauge      KV blocks owned by sequences
lmdeploy_kv_cache_usage_ratio               gauge      used / total
lmdeploy_engine_generated_tokens_total      counter    tokens the engine sampled
lmdeploy_engine_preemptions_total           counter    sequences preempted (recomputed later)
lmdeploy_prefix_cache_hit_tokens_total      counter    prompt tokens served from the prefix cache
lmdeploy_engine_step_steps_total            counter    engine steps {phase: prefill (with prompt rows) | decode}
lmdeploy_engine_step_tokens_total           counter    tokens those steps ran {phase}
lmdeploy_engine_step_seconds_total          counter    host seconds of those steps {phase}
lmdeploy_engine_step_device_seconds_total   counter    device seconds of those steps {phase}
process_cpu_seconds_total                   counter    the API process's CPU time (and prometheus' other process_*)
lmdeploy_api_requests_in_flight             gauge      generation requests the server is handling
lmdeploy_requests_total                     counter    finished generation requests {endpoint, finish_reason}
lmdeploy_prompt_tokens_total                counter    prompt tokens of finished requests
lmdeploy_generation_tokens_total            counter    tokens returned to clients
lmdeploy_time_to_first_token_seconds        histogram  request arrival -> first token (streaming requests)
lmdeploy_time_per_output_token_seconds      histogram  time between output tokens (streaming requests)
lmdeploy_e2e_request_latency_seconds        histogram  request arrival -> last output
lmdeploy_http_errors_total                  counter    error responses {status}
==========================================  =========  ===================================================
"""
from __future__ import annotations

import bisect
import threading
import time
from typing import Callable, Optional

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

__all__ = ['ServerMetrics', 'RequestTimer', 'CONTENT_TYPE_LATEST']

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _EngineCollector:
    """Reads ``Engine.stats()`` when scraped (call collect off the event loop:
    the engine's lock is held for a whole step)."""

    def __init__(self, get_engine: Callable[[], Optional[object]]):
        self._get_engine = get_engine

    def describe(self):
        return []

    def collect(self):
        engine = self._get_engine()
        if engine is None:
            return
        s = engine.stats()
        used = s.num_blocks - s.num_free_blocks

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            return c

        yield gauge('lmdeploy_num_requests_running', 'Sequences the engine is running.', s.num_running)
        yield gauge('lmdeploy_num_requests_waiting', 'Sequences queued in the engine.', s.num_waiting)
        yield gauge('lmdeploy_num_idle_sessions', 'Interactive sessions holding a KV cache between turns.',
                    s.num_idle_sessions)
        yield gauge('lmdeploy_kv_cache_blocks_total', 'KV cache blocks.', s.num_blocks)
        yield gauge('lmdeploy_kv_cache_capacity_tokens', 'Tokens the KV cache holds.', s.num_blocks * s.block_size)
        yield gauge('lmdeploy_kv_cache_quant_policy', 'KV cache quantization: 0 none, 8 int8, 4 int4.',
                    s.quant_policy)
        yield gauge('lmdeploy_kv_cache_blocks_free', 'Free KV cache blocks.', s.num_free_blocks)
        yield gauge('lmdeploy_kv_cache_blocks_used', 'KV cache blocks owned by sequences.', used)
        yield gauge('lmdeploy_kv_cache_usage_ratio', 'Used / total KV cache blocks.',
                    used / s.num_blocks if s.num_blocks else 0.0)
        yield counter('lmdeploy_engine_generated_tokens', 'Tokens the engine sampled.', s.num_generated_tokens)
        yield counter('lmdeploy_engine_preemptions', 'Sequences preempted by the scheduler.', s.num_preemptions)
        yield counter('lmdeploy_prefix_cache_hit_tokens', 'Prompt tokens served from the prefix cache.',
                      s.num_prefix_hit_tokens)
        # the steps' make-up: 'prefill' steps carry prompt rows (and the decoding sequences), 'decode' steps
        # only one-token rows; device seconds come from the device's own marks (where it has them)
        extra = s.extra or {}
        for key, doc in (('steps', 'Engine steps run.'), ('tokens', 'Tokens the engine steps ran.'),
                         ('seconds', 'Host seconds of the engine steps.'),
                         ('device_seconds', 'Device seconds of the engine steps.')):
            c = CounterMetricFamily(f'lmdeploy_engine_step_{key}', doc, labels=['phase'])
            for phase in ('prefill', 'decode'):
                if f'{phase}_{key}' in extra:
                    c.add_metric([phase], extra[f'{phase}_{key}'])
            yield c


class _TokenHistogram:
    """A histogram observed once per streamed token: bucket counts kept as plain integers (prometheus_client's
    Histogram.observe costs tens of microseconds, thousands of times a second under load), one value observed
    ``count`` times at once, exposed at scrape time."""

    def __init__(self, name: str, doc: str, buckets):
        self.name, self.doc = name, doc
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1):
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self.counts[i] += count
            self.sum += value * count

    def collect(self):
        with self._lock:
            counts, total = list(self.counts), self.sum
        cumulative, running = [], 0
        for bound, n in zip(self.bounds + [float('inf')], counts):
            running += n
            cumulative.append(('+Inf' if bound == float('inf') else repr(float(bound)), running))
        yield HistogramMetricFamily(self.name, self.doc, buckets=cumulative, sum_value=total)


class ServerMetrics:

    def __init__(self, get_engine: Callable[[], Optional[object]]):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total etc.: the API process's own CPU under load
        self.in_flight = Gauge('lmdeploy_api_requests_in_flight', 'Generation requests the server is handling.',
                               registry=r)
        self.requests = Counter('lmdeploy_requests', 'Finished generation requests.', ['endpoint', 'finish_reason'],
                                registry=r)
        self.prompt_tokens = Counter('lmdeploy_prompt_tokens', 'Prompt tokens of finished requests.', registry=r)
        self.generation_tokens = Counter('lmdeploy_generation_tokens', 'Generated tokens returned to clients.',
                                         registry=r)
        self.ttft = Histogram('lmdeploy_time_to_first_token_seconds', 'Request arrival to first token.',
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = _TokenHistogram('lmdeploy_time_per_output_token_seconds', 'Time between output tokens.',
                                    _TPOT_BUCKETS)
        r.register(self.tpot)
        self.e2e = Histogram('lmdeploy_e2e_request_latency_seconds', 'Request arrival to last output.',
                             buckets=_E2E_BUCKETS, registry=r)
        self.http_errors = Counter('lmdeploy_http_errors', 'Error responses.', ['status'], registry=r)
        r.register(_EngineCollector(get_engine))

    def render(self) -> bytes:
        """The text exposition (blocking: run it in a thread)."""
        return generate_latest(self.registry)

    def timer(self, endpoint: str, streaming: bool = True) -> 'RequestTimer':
        return RequestTimer(self, endpoint, streaming)


class RequestTimer:
    """Observes one request's latencies; made at arrival, ``tokens`` as
    outputs come, ``finish`` once (idempotent). A non-streaming request gets its
    tokens all at once at the end: it counts in the e2e latency only."""

    def __init__(self, metrics: ServerMetrics, endpoint: str, streaming: bool = True):
        self.m = metrics
        self.endpoint = endpoint
        self.streaming = streaming
        self.t0 = time.perf_counter()
        self.last: Optional[float] = None
        self.num_tokens = 0
        self.prompt_tokens = 0
        self._done = False
        metrics.in_flight.inc()

    def tokens(self, n: int):
        if n <= 0:
            return
        now = time.perf_counter()
        if not self.streaming:
            pass
        elif self.last is None:
            self.m.ttft.observe(now - self.t0)
        else:
            self.m.tpot.observe((now - self.last) / n, n)
        self.last = now
        self.num_tokens += n

    def finish(self, finish_reason: Optional[str]):
        if self._done:
            return
        self._done = True
        self.m.in_flight.dec()
        self.m.requests.labels(self.endpoint, finish_reason or 'none').inc()
        self.m.prompt_tokens.inc(self.prompt_tokens)
        self.m.generation_tokens.inc(self.num_tokens)
        self.m.e2e.observe(time.perf_counter() - self.t0)
