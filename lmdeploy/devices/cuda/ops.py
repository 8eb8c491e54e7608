"""NVIDIA GPUs: Triton kernels for the memory-bound ops, compiled CUDA
kernels (csrc/cuda) where they are built and faster (compiled.py), cuBLAS
(through torch) for the GEMMs, torch-on-GPU for sampling (no host round trip
per request), CUDA graphs for decode steps."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import torch.nn.functional as F

from ..interface import DeviceOps
from ..reference import ReferenceSampling


class CudaOps(ReferenceSampling, DeviceOps):
    name = 'cuda'
    torch_device_type = 'cuda'
    auto_priority = 30
    quant_policies = (0, 4, 8)  # KV int8 / int4: quantized in the fill kernels, dequantized in attention
    supports_graphs = True
    supports_graph_pieces = True
    profile_memory = True
    collective_backend = 'nccl'
    ray_resource = 'GPU'

    def __init__(self, num_sms: Optional[int] = None):
        """``num_sms``: the GPU's multiprocessor count (default: asked of the current GPU; tests that run the
        kernels in Triton's interpreter pass one)."""
        from .kernels import activation, argmax, attention, kv_cache, linear, norm, rotary
        self._k_attention, self._k_kv, self._k_norm, self._k_linear = attention, kv_cache, norm, linear
        self._k_rotary, self._k_act, self._k_argmax = rotary, activation, argmax
        self._num_sms = num_sms or torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        # per op, the compiled kernel (csrc/cuda) or the Triton one (compiled.py says how it is chosen)
        from . import compiled
        self._compiled = compiled
        self.compiled_from = compiled.compiled_from(torch.cuda.get_device_capability()
                                                    if torch.cuda.is_available() else None)

    def kv_cache_spec(self, num_kv_heads, head_dim, block_size, dtype, quant_policy=0):
        """Quantized caches stored head-major (devices/cache.py): a tile of one KV head's tokens is one run of
        bytes, where token-major blocks scatter it in rows of D or D / 2 bytes (H100, batch 256 x 8k
        contexts, the compiled decode kernel: int4 66 -> 92 % of the copy ceiling, int8 90 -> 95 %). The
        16-bit cache keeps the token-major layout (256-byte rows already read at 95-97 %)."""
        spec = super().kv_cache_spec(num_kv_heads, head_dim, block_size, dtype, quant_policy)
        return dataclasses.replace(spec, head_major=True) if quant_policy else spec

    def set_device_index(self, index: int) -> None:
        torch.cuda.set_device(index)

    @classmethod
    def is_available(cls) -> bool:
        return cls.unavailable_reason() is None

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if not torch.cuda.is_available():
            if torch.version.cuda is None and getattr(torch.version, 'hip', None) is None:
                return f'this torch ({torch.__version__}) is not a CUDA build'
            hidden = os.environ.get('CUDA_VISIBLE_DEVICES')
            return ('torch sees no CUDA GPU (no NVIDIA driver or GPU here' +
                    (f', or CUDA_VISIBLE_DEVICES={hidden!r} hides them)' if hidden is not None else ')'))
        try:
            import triton  # noqa: F401
        except ImportError:
            return 'triton is not installed (pip install triton)'
        return None

    def torch_device(self) -> torch.device:
        return torch.device('cuda', torch.cuda.current_device())

    def memory_available(self) -> int:
        free, _ = torch.cuda.mem_get_info()
        return int(free)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def to_host_async(self, t):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait():
            done.synchronize()  # releases the GIL while the device works
            return host
        return wait

    def timestamp(self):
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def seconds_between(self, start, end):
        return start.elapsed_time(end) / 1e3 if end.query() else None

    def default_dtype(self, config_dtype: torch.dtype) -> torch.dtype:
        if config_dtype == torch.float32 or (config_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported()):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return config_dtype

    def capture_graph(self, fn, pool=None):
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up: compiles kernels, settles the allocator
            fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph.replay, out, graph.pool()

    def capture_pieces(self, fn, pool=None):
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up, as capture_graph
            fn(lambda: None)
        current.wait_stream(side)
        torch.cuda.synchronize()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        graphs = []

        def begin():
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)

        def cut():
            graphs[-1].capture_end()
            begin()

        with torch.cuda.stream(side):
            begin()
            out = fn(cut)
            graphs[-1].capture_end()
        current.wait_stream(side)
        return [g.replay for g in graphs], out, pool

    # -------------------------------------------------------------- dense ops
    def embedding(self, ids, weight):
        return F.embedding(ids, weight)

    def linear(self, x, weight, bias=None):
        if self._k_linear.fits(x, weight):  # a few rows: weight-streaming kernel, no split-K pass
            return self._k_linear.skinny_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def linear_silu_and_mul(self, x, weight, bias=None):
        if self._k_linear.fits(x, weight) and weight.shape[0] % 2 == 0:
            return self._k_linear.skinny_linear_silu_and_mul(x, weight, bias)
        return super().linear_silu_and_mul(x, weight, bias)

    def rms_norm(self, x, weight, eps, residual=None):
        return self._k_norm.rms_norm(x, weight, eps, residual)

    def apply_rotary(self, q, k, cos, sin):
        return self._k_rotary.apply_rotary(q, k, cos, sin)

    def silu_and_mul(self, x):
        return self._k_act.silu_and_mul(x)

    # ------------------------------------------------------------- attention
    def fill_kv_cache(self, k, v, cache, slot_mapping):
        self._k_kv.fill_kv_cache(k, v, cache.k, cache.v, slot_mapping, cache.k_scale_zero, cache.v_scale_zero,
                                 cache.k_mean, rows=cache.rows)

    def rotary_fill_kv(self, q, k, v, cos, sin, cache, slot_mapping):
        rows = self.compiled_from[self._compiled.choice_key('rotary_fill_kv', cache.quant_policy)]
        if rows is not None and q.shape[0] in rows:
            done = self._compiled.rotary_fill_kv(q, k, v, cos, sin, cache, slot_mapping)
            if done is not None:
                return done
        return self._k_kv.rotary_fill_kv(q, k, v, cos, sin, cache.k, cache.v, slot_mapping, cache.k_scale_zero,
                                         cache.v_scale_zero, cache.k_mean, rows=cache.rows)

    def paged_prefill_attention(self, q, cache, block_tables, q_start_loc, q_seqlens, kv_seqlens, scale, max_q_len,
                                max_kv_len, out=None):
        return self._k_attention.paged_prefill_attention(q, cache.k, cache.v, block_tables, q_start_loc, q_seqlens,
                                                         kv_seqlens, scale, max_q_len, max_kv_len, out=out,
                                                         k_scale_zero=cache.k_scale_zero,
                                                         v_scale_zero=cache.v_scale_zero)

    def paged_decode_attention(self, q, cache, block_tables, kv_seqlens, scale, max_kv_len, order=None, out=None):
        rows = self.compiled_from[self._compiled.choice_key('paged_decode_attention', cache.quant_policy)]
        if rows is not None and q.shape[0] in rows:
            done = self._compiled.paged_decode_attention(q, cache, block_tables, kv_seqlens, scale, max_kv_len,
                                                         self._num_sms, order, out)
            if done is not None:
                return done
        return self._k_attention.paged_decode_attention(q, cache.k, cache.v, block_tables, kv_seqlens, scale,
                                                        max_kv_len, self._num_sms, order, out=out,
                                                        k_scale_zero=cache.k_scale_zero,
                                                        v_scale_zero=cache.v_scale_zero)

    # -------------------------------------------------------------- sampling (the rest: ReferenceSampling)
    def argmax(self, logits):
        return self._k_argmax.argmax(logits)
