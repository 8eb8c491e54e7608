"""The compiled CUDA kernels (csrc/cuda, built into the module ``_C``) and which implementation of an op
the cuda device runs: the compiled kernel or the Triton one.

``LMDEPLOY_CUDA_KERNELS``: ``auto`` (default) uses a compiled kernel where the module is present and the
kernel was measured faster than Triton's on that GPU generation for that KV cache policy and for calls of
that many rows (:data:`FASTER`, :func:`compiled_from`);
``triton`` never uses them; ``compiled`` uses them wherever they take the inputs (and refuses to start without the
module). The engine never knows which ran.

The module takes raw pointers; the wrappers here check what it needs (dtypes, contiguity, head
sizes) and return None for inputs outside it, so the caller falls back to Triton.
"""
from __future__ import annotations

import importlib
import os
from typing import Dict, Optional, Tuple

import torch

from .splits import min_slice_tokens, num_decode_splits

MODES = ('auto', 'triton', 'compiled')
OPS = ('paged_decode_attention', 'rotary_fill_kv')
_POLICY_SUFFIX = {0: '', 8: '[int8]', 4: '[int4]'}


def choice_key(op: str, quant_policy: int = 0) -> str:
    """The name a choice is made under: per op and KV cache policy (the kernels' costs differ by policy)."""
    return op + _POLICY_SUFFIX[quant_policy]


CHOICES = tuple(choice_key(op, p) for op in OPS for p in _POLICY_SUFFIX)
ANY = range(0, 1 << 62)  # every call
# choice -> {compute capability (major, minor): the rows of a call (decode: sequences; rotary fill: tokens)
# for which the compiled kernel was measured faster than Triton's} (benchmark/kv_quant_attn.py,
# rotary_fill.py and latency.py; benchmark/RESULTS.md). auto runs it there, and for every call on GPUs
# Triton serves poorly (before sm80 Triton's attention runs without bfloat16 and its tensor-core paths).
FASTER: Dict[str, Dict[Tuple[int, int], range]] = {
    # H100: 1.2-1.4x at 64-256 sequences alone; under a decode graph's slicing bound 1.28x at one sequence,
    # 1.32x at 16, 1.52x at 32 (its lookups and first tiles before the wait for the kernel ahead; before that
    # it was slower at one sequence and auto ran it from 64); one sequence decodes as fast end to end
    'paged_decode_attention[int8]': {(9, 0): ANY},
    # H100: 1.37-1.57x at 64-256 sequences alone; under a graph's bound 1.13x at 1, 1.10x at 16; one
    # sequence decodes as fast or faster end to end
    'paged_decode_attention[int4]': {(9, 0): ANY},
    # H100: 1.54x at 64 tokens a call, 1.63x at 256, 0.90x at 2,048 (int4's K rotation is a tensor-core dot a
    # token in Triton's kernel); the mean key (devices/cache.py) taken off K as Triton's does
    'rotary_fill_kv[int4]': {(9, 0): range(0, 257)},
}
_BEFORE_TRITON = (8, 0)

_module = None
_error: Optional[str] = None


def module():
    """The loaded ``_C`` module, or None (:func:`load_error` says why)."""
    global _module, _error
    if _module is None and _error is None:
        try:
            _module = importlib.import_module('lmdeploy.devices.cuda._C')
        except ImportError as e:
            _error = f'{e} (build it: python csrc/build.py)'
    return _module


def load_error() -> Optional[str]:
    module()
    return _error


def mode() -> str:
    value = os.environ.get('LMDEPLOY_CUDA_KERNELS', 'auto').strip().lower() or 'auto'
    if value not in MODES:
        raise ValueError(f'LMDEPLOY_CUDA_KERNELS must be one of {", ".join(MODES)}, got {value!r}')
    return value


def _min_rows_override() -> Optional[int]:
    text = os.environ.get('LMDEPLOY_CUDA_COMPILED_MIN_ROWS', '').strip()
    if not text:
        return None
    try:
        rows = int(text)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f'LMDEPLOY_CUDA_COMPILED_MIN_ROWS must be a whole number >= 0, got {text!r}')
    return rows


def compiled_from(capability: Optional[Tuple[int, int]]) -> Dict[str, Optional[range]]:
    """choice (:func:`choice_key`) -> the rows a call must have for the cuda device to run the compiled
    kernel on a GPU of this compute capability, None where Triton's always runs (no GPU: None everywhere).
    ``LMDEPLOY_CUDA_COMPILED_MIN_ROWS`` moves where each range auto takes from :data:`FASTER` starts."""
    if capability is None:
        return {key: None for key in CHOICES}
    m = mode()
    if m == 'compiled' and module() is None:
        raise RuntimeError(f'LMDEPLOY_CUDA_KERNELS=compiled, but the compiled kernels are missing: {load_error()}')
    if m == 'triton' or module() is None:
        return {key: None for key in CHOICES}
    cap = tuple(capability)
    if m == 'compiled' or cap < _BEFORE_TRITON:
        return {key: ANY for key in CHOICES}
    start = _min_rows_override()
    plan = {key: FASTER.get(key, {}).get(cap) for key in CHOICES}
    return {key: rows if rows is None or start is None else range(start, rows.stop) for key, rows in plan.items()}


def describe_rows(rows: range) -> str:
    """Where a range of :func:`compiled_from` runs the compiled kernel, in words (check_env)."""
    low, high = rows.start <= 1, rows.stop == ANY.stop
    if low and high:
        return 'compiled'
    if high:
        return f'compiled from {rows.start} rows a call, triton below'
    if low:
        return f'compiled up to {rows.stop - 1} rows a call, triton above'
    return f'compiled for {rows.start}-{rows.stop - 1} rows a call, triton otherwise'


_DTYPES = {torch.float16: 0, torch.bfloat16: 1}
_pdl_by_device: Dict[int, int] = {}


def _pdl(device: torch.device) -> int:
    """1 where the kernels launch with programmatic dependent launch, as the Triton ones do
    (kernels/pdl.py: sm90+, unless ``LMDEPLOY_PDL=0``), so a compiled kernel between Triton ones keeps
    the overlap of their launches."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _pdl_by_device:
        on = os.environ.get('LMDEPLOY_PDL', '1') != '0' and torch.cuda.get_device_capability(index)[0] >= 9
        _pdl_by_device[index] = int(on)
    return _pdl_by_device[index]


DECODE_KERNELS = ('auto', 'cuda_cores', 'tensor_cores')


def _cache_rows(cache) -> Optional[Tuple[int, int, int]]:
    """The cache's (block, slot, head) strides in rows, as the kernels address it (ops.h CacheRows); None for
    a layout they cannot take."""
    try:
        return cache.rows
    except ValueError:
        return None


def paged_decode_attention(q, cache, block_tables, kv_seqlens, scale, max_kv_len, num_sms, order=None,
                           out=None, kernel: str = 'auto', sliding_window=None,
                           logit_softcap=None) -> Optional[torch.Tensor]:
    """DeviceOps.paged_decode_attention by the compiled kernel; None where it does not take the inputs.
    ``kernel``: ``auto`` runs the tensor-core kernel where it runs (sm80+, block size a multiple of 16),
    else the CUDA-core one; the others force one (for tests and benchmarks). The kernels implement neither a
    sliding window nor soft-capped scores: None with either (Triton's kernel has both)."""
    if sliding_window is not None or logit_softcap is not None:
        return None
    mod = module()
    if mod is None or q.dtype not in _DTYPES or q.dim() != 3 or q.stride(-1) != 1:
        return None
    bsz, h, d = q.shape
    k, v = cache.k, cache.v
    hkv = k.shape[2]
    policy = cache.quant_policy
    if not mod.decode_attention_supports(_DTYPES[q.dtype], policy, d, h, hkv):
        return None
    rows = _cache_rows(cache)
    if rows is None or not (block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
                            and kv_seqlens.dtype == torch.int64 and kv_seqlens.is_contiguous()):
        return None
    if policy == 0 and k.dtype != q.dtype:
        return None
    if order is not None and not (order.dtype == torch.int64 and order.is_contiguous()):
        order = None
    out = torch.empty_like(q) if out is None else out
    if out.stride(-1) != 1:
        return None
    if bsz == 0:
        return out
    splits = num_decode_splits(bsz, hkv, max_kv_len, num_sms)
    part = torch.empty((bsz, h, splits, d + 1) if splits > 1 else (1, ), dtype=torch.float32, device=q.device)
    ksz = cache.k_scale_zero.data_ptr() if policy else 0
    vsz = cache.v_scale_zero.data_ptr() if policy else 0
    mod.paged_decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), ksz, vsz, part.data_ptr(), out.data_ptr(),
                               block_tables.data_ptr(), kv_seqlens.data_ptr(),
                               0 if order is None else order.data_ptr(), _DTYPES[q.dtype], policy, bsz, h, hkv, d,
                               k.shape[1], splits, min_slice_tokens(bsz, hkv, num_sms), *rows, q.stride(0),
                               q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), float(scale),
                               torch.cuda.current_stream(q.device).cuda_stream, DECODE_KERNELS.index(kernel),
                               _pdl(q.device))
    return out


def rotary_fill_kv(q, k, v, cos, sin, cache, slot_mapping) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """DeviceOps.rotary_fill_kv by the compiled kernel (rotated q and k as views of one buffer, as the Triton
    kernel returns them); None where it does not take the inputs."""
    from lmdeploy.devices.cache import rotates_k
    mod = module()
    if mod is None or q.dtype not in _DTYPES or not (k.dtype == v.dtype == q.dtype) or q.dim() != 3:
        return None
    t, h, d = q.shape
    hkv = k.shape[1]
    policy = cache.quant_policy
    if not mod.rotary_fill_supports(_DTYPES[q.dtype], policy, d):
        return None
    rows = _cache_rows(cache)
    if rows is None or any(x.stride(-1) != 1 for x in (q, k, v)):
        return None
    if policy == 0 and cache.k.dtype != q.dtype:
        return None
    if slot_mapping.dtype != torch.int64:
        return None
    out = torch.empty((t, h + hkv, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out[:, :h], out[:, h:]
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    slots = slot_mapping.contiguous()
    ksz = cache.k_scale_zero.data_ptr() if policy else 0
    vsz = cache.v_scale_zero.data_ptr() if policy else 0
    mod.rotary_fill_kv(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                       slots.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), ksz, vsz,
                       cache.k_mean.data_ptr() if cache.k_mean is not None else 0, _DTYPES[q.dtype], policy,
                       int(rotates_k(policy, d)), t, h, hkv, d, cache.k.shape[1], *rows, q.stride(0), q.stride(1),
                       k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
                       torch.cuda.current_stream(q.device).cuda_stream, _pdl(q.device))
    return out[:, :h], out[:, h:]
