"""NVIDIA GPUs: Triton kernels for the memory-bound ops, compiled CUDA
kernels (csrc/cuda) where they are built and faster (compiled.py), cuBLAS
(through torch) for the GEMMs, torch-on-GPU for sampling's filters (no host round trip
per request). Its services (memory, events, CUDA graphs, NCCL) are runtime.py's."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from ..act_quant import QuantizedInput, quantize_input
from ..interface import DeviceOps
from ..reference import ReferenceSampling
from .runtime import CudaRuntime
from .w4a16 import W4A16_IMPLS
from .w8a8 import INT_MM_MIN_ROWS, W8A8_IMPLS


class CudaOps(ReferenceSampling, DeviceOps):
    name = 'cuda'
    runtime_class = CudaRuntime  # memory, events, graphs, NCCL (runtime.py)
    quant_policies = (0, 4, 8)  # KV int8 / int4: quantized in the fill kernels, dequantized in attention
    # AWQ / GPTQ through the W4A16 kernel (w4a16.py), SmoothQuant W8A8 through 8-bit GEMMs (w8a8.py); the rest:
    # the reference's
    layer_impls = {**W4A16_IMPLS, **W8A8_IMPLS}

    def __init__(self, num_sms: Optional[int] = None):
        """``num_sms``: the GPU's multiprocessor count (default: asked of the current GPU; tests that run the
        kernels in Triton's interpreter pass one)."""
        from .kernels import activation, argmax, attention, kv_cache, linear, norm, rotary, sample, w8a8_quant
        self._k_attention, self._k_kv, self._k_norm, self._k_linear = attention, kv_cache, norm, linear
        self._k_quant = w8a8_quant
        self._k_rotary, self._k_act, self._k_argmax, self._k_sample = rotary, activation, argmax, sample
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

    def default_dtype(self, config_dtype: torch.dtype) -> torch.dtype:
        if config_dtype == torch.float32 or (config_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported()):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return config_dtype

    # ------------------------------------------------- collectives in a step
    def all_reduce(self, x):
        """Small messages (a decode step's) in one shot through peer buffers (peer_all_reduce.py), the rest
        through NCCL."""
        import torch.distributed as dist
        peer = self.__dict__.get('_peer_all_reduce')
        if peer is None or peer.world is not dist.group.WORLD:  # made for this process group, not an earlier one
            from .peer_all_reduce import PeerAllReduce
            peer = self._peer_all_reduce = PeerAllReduce(dist.group.WORLD)
        out = peer(x)
        return out if out is not None else super().all_reduce(x)

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

    def gelu_tanh_and_mul(self, x):
        return self._k_act.gelu_tanh_and_mul(x)

    def gelu(self, x, approximate='none'):
        return self._k_act.gelu(x, approximate)

    def layer_norm(self, x, weight, bias, eps):
        return self._k_norm.layer_norm(x, weight, bias, eps)

    # ------------------------------------------------ quantized activations
    # Triton kernels (kernels/w8a8_quant.py) for 16- and 32-bit inputs, e4m3 codes from sm89 on (where the GEMM
    # takes them); int8 codes come with at least INT_MM_MIN_ROWS rows (zeros past the input's: w8a8.py)
    def _quantizes(self, x, fp8) -> bool:
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False
        return not (fp8 and x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9))

    @staticmethod
    def _quantized(q, scale, x) -> QuantizedInput:
        """The codes of the rows of x [..., K] (x: the float input, or a gated activation's [..., 2I])."""
        return QuantizedInput(q, scale, x.numel() // x.shape[-1], x.dtype, tuple(x.shape[:-1]))

    def quantize_per_token(self, x, fp8):
        if not self._quantizes(x, fp8):
            return quantize_input(x, fp8)
        q, scale = self._k_quant.quantize_per_token(x.reshape(-1, x.shape[-1]), fp8,
                                                    min_rows=0 if fp8 else INT_MM_MIN_ROWS)
        return self._quantized(q, scale, x)

    def rms_norm_quant(self, x, weight, eps, residual, fp8):
        if not self._quantizes(x, fp8):
            return super().rms_norm_quant(x, weight, eps, residual, fp8)
        q, scale, res = self._k_quant.rms_norm_quant(x, weight, eps, residual, fp8,
                                                     min_rows=0 if fp8 else INT_MM_MIN_ROWS)
        return self._quantized(q, scale, x), res

    def silu_and_mul_quant(self, x, fp8):
        if not self._quantizes(x, fp8):
            return super().silu_and_mul_quant(x, fp8)
        q, scale = self._k_quant.silu_and_mul_quant(x.reshape(-1, x.shape[-1]), fp8,
                                                    min_rows=0 if fp8 else INT_MM_MIN_ROWS)
        return self._quantized(q, scale, x)

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
                                max_kv_len, out=None, sliding_window=None, logit_softcap=None, alibi_slopes=None):
        return self._k_attention.paged_prefill_attention(q, cache.k, cache.v, block_tables, q_start_loc, q_seqlens,
                                                         kv_seqlens, scale, max_q_len, max_kv_len, out=out,
                                                         k_scale_zero=cache.k_scale_zero,
                                                         v_scale_zero=cache.v_scale_zero, sliding_window=sliding_window,
                                                         logit_softcap=logit_softcap, k_mean=cache.k_mean,
                                                         alibi_slopes=alibi_slopes)

    def paged_decode_attention(self, q, cache, block_tables, kv_seqlens, scale, max_kv_len, order=None, out=None,
                               sliding_window=None, logit_softcap=None, alibi_slopes=None):
        rows = self.compiled_from[self._compiled.choice_key('paged_decode_attention', cache.quant_policy)]
        if rows is not None and q.shape[0] in rows and alibi_slopes is None:  # (the compiled kernels: no ALiBi)
            done = self._compiled.paged_decode_attention(q, cache, block_tables, kv_seqlens, scale, max_kv_len,
                                                         self._num_sms, order, out, sliding_window=sliding_window,
                                                         logit_softcap=logit_softcap)
            if done is not None:
                return done
        return self._k_attention.paged_decode_attention(q, cache.k, cache.v, block_tables, kv_seqlens, scale,
                                                        max_kv_len, self._num_sms, order, out=out,
                                                        k_scale_zero=cache.k_scale_zero,
                                                        v_scale_zero=cache.v_scale_zero, sliding_window=sliding_window,
                                                        logit_softcap=logit_softcap, k_mean=cache.k_mean,
                                                        alibi_slopes=alibi_slopes)

    # -------------------------------------------------------------- sampling (the rest: ReferenceSampling)
    def argmax(self, logits):
        return self._k_argmax.argmax(logits)

    def sample(self, logits, seeds, offsets):
        # the seeded draw in two launches (the reference's counter-based random numbers are ~60 torch ops)
        if logits.dim() == 2 and logits.dtype == torch.float32:
            return self._k_sample.sample(logits, seeds, offsets)
        return super().sample(logits, seeds, offsets)
