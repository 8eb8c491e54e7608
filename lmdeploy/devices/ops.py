"""Op dispatch: what models and the engine call.

Each function forwards to the :class:`~.interface.DeviceOps` of the device
its first tensor lives on. See the interface for what each op means.
"""
from __future__ import annotations

import torch

from . import serving
from .interface import DeviceOps


def _ops(t: torch.Tensor) -> DeviceOps:
    return serving(t.device.type)


def embedding(ids, weight):
    return _ops(weight).embedding(ids, weight)


def linear(x, weight, bias=None):
    return _ops(x).linear(x, weight, bias)


def rms_norm(x, weight, eps, residual=None):
    return _ops(x).rms_norm(x, weight, eps, residual)


def apply_rotary(q, k, cos, sin):
    return _ops(q).apply_rotary(q, k, cos, sin)


def silu_and_mul(x):
    return _ops(x).silu_and_mul(x)


def linear_silu_and_mul(x, weight, bias=None):
    return _ops(x).linear_silu_and_mul(x, weight, bias)


def fill_kv_cache(k, v, cache, slot_mapping):
    return _ops(k).fill_kv_cache(k, v, cache, slot_mapping)


def rotary_fill_kv(q, k, v, cos, sin, cache, slot_mapping):
    return _ops(q).rotary_fill_kv(q, k, v, cos, sin, cache, slot_mapping)


def paged_prefill_attention(q, cache, block_tables, q_start_loc, q_seqlens, kv_seqlens, scale, max_q_len, max_kv_len,
                            out=None):
    return _ops(q).paged_prefill_attention(q, cache, block_tables, q_start_loc, q_seqlens, kv_seqlens, scale,
                                           max_q_len, max_kv_len, out)


def paged_decode_attention(q, cache, block_tables, kv_seqlens, scale, max_kv_len, order=None, out=None):
    return _ops(q).paged_decode_attention(q, cache, block_tables, kv_seqlens, scale, max_kv_len, order, out)


def apply_repetition_penalty(logits, token_ids, penalty):
    return _ops(logits).apply_repetition_penalty(logits, token_ids, penalty)


def apply_frequency_presence_penalty(logits, token_ids, frequency, presence):
    return _ops(logits).apply_frequency_presence_penalty(logits, token_ids, frequency, presence)


def apply_temperature(logits, temperature):
    return _ops(logits).apply_temperature(logits, temperature)


def apply_token_bitmask(logits, bitmask):
    return _ops(logits).apply_token_bitmask(logits, bitmask)


def top_k_top_p_min_p(logits, top_k, top_p, min_p, max_top_k=None):
    return _ops(logits).top_k_top_p_min_p(logits, top_k, top_p, min_p, max_top_k)


def sample(logits, seeds, offsets):
    return _ops(logits).sample(logits, seeds, offsets)


def argmax(logits):
    return _ops(logits).argmax(logits)


def all_reduce(x):
    return _ops(x).all_reduce(x)


def all_gather(x):
    return _ops(x).all_gather(x)


def broadcast(x, src=0):
    return _ops(x).broadcast(x, src)
