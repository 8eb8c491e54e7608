"""The compiled CUDA kernels (csrc/cuda, built into the module ``_C``) and which implementation of an op
the cuda device runs: the compiled kernel or the Triton one.

``LMDEPLOY_CUDA_KERNELS``: ``auto`` (default) uses a compiled kernel where the module is present and the
kernel was measured faster than Triton's on that GPU generation for that KV cache policy (:data:`FASTER`),
for calls of at least :func:`min_rows` rows;
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

from .splits import num_decode_splits

MODES = ('auto', 'triton', 'compiled')
OPS = ('paged_decode_attention', 'rotary_fill_kv')
_POLICY_SUFFIX = {0: '', 8: '[int8]', 4: '[int4]'}


def choice_key(op: str, quant_policy: int = 0) -> str:
    """The name a choice is made under: per op and KV cache policy (the kernels' costs differ by policy)."""
    return op + _POLICY_SUFFIX[quant_policy]


CHOICES = tuple(choice_key(op, p) for op in OPS for p in _POLICY_SUFFIX)
# choice -> compute capabilities (major, minor) where the compiled kernel beat Triton's
# (benchmark/kv_quant_attn.py and rotary_fill.py; benchmark/RESULTS.md); auto uses it there, and on GPUs
# Triton does not serve (before sm80 Triton's attention runs without bfloat16 and its tensor-core paths)
FASTER: Dict[str, Tuple[Tuple[int, int], ...]] = {
    'paged_decode_attention[int8]': ((9, 0), ),  # H100: 1.02-1.30x Triton's speed
    'paged_decode_attention[int4]': ((9, 0), ),  # H100: 1.13-1.27x
}
_BEFORE_TRITON = (8, 0)
# auto runs a FASTER kernel only for calls of this many rows (decode: sequences) or more, and Triton's below.
# H100, Llama-3-8B shape, one sequence (benchmark/latency.py 512 in / 256 out): Triton's decode attention
# gave 5.86 ms a token with int8 KV and 6.04 with int4, the compiled one 6.18 and 6.19, though the kernel
# alone was faster at that size (benchmarked in 2 slices; a decode graph cuts batch 1 into 32, and the
# compiled slice merge walks them one by one); at ~200 sequences the compiled one was faster end to end
# (long decode: int8 1.09x, int4 1.04x). Between 1 and ~200 rows nothing was measured end to end: 32 is a
# guess, set by $LMDEPLOY_CUDA_COMPILED_MIN_ROWS.
AUTO_MIN_ROWS = 32

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


def min_rows(capability: Tuple[int, int]) -> Dict[str, int]:
    """choice -> the fewest rows a call needs to run the compiled kernel (where :func:`choose` says
    'compiled'): ``AUTO_MIN_ROWS`` for the kernels auto takes from :data:`FASTER`, else 0."""
    if mode() != 'auto' or tuple(capability) < _BEFORE_TRITON:
        return {key: 0 for key in CHOICES}
    text = os.environ.get('LMDEPLOY_CUDA_COMPILED_MIN_ROWS', '').strip()
    try:
        rows = int(text) if text else AUTO_MIN_ROWS
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f'LMDEPLOY_CUDA_COMPILED_MIN_ROWS must be a whole number >= 0, got {text!r}')
    return {key: rows if key in FASTER else 0 for key in CHOICES}


def choose(capability: Tuple[int, int]) -> Dict[str, str]:
    """choice (:func:`choice_key`) -> 'compiled' or 'triton' on a GPU of this compute capability."""
    m = mode()
    if m == 'compiled' and module() is None:
        raise RuntimeError(f'LMDEPLOY_CUDA_KERNELS=compiled, but the compiled kernels are missing: {load_error()}')
    if m == 'triton' or module() is None:
        return {key: 'triton' for key in CHOICES}
    if m == 'compiled':
        return {key: 'compiled' for key in CHOICES}
    cap = tuple(capability)
    return {key: 'compiled' if cap in FASTER.get(key, ()) or cap < _BEFORE_TRITON else 'triton' for key in CHOICES}


def compiled_from(capability: Optional[Tuple[int, int]]) -> Dict[str, Optional[int]]:
    """choice -> the fewest rows a call needs to run the compiled kernel, None where Triton's always runs
    (:func:`choose` and :func:`min_rows` together; no GPU: None everywhere)."""
    if capability is None:
        return {key: None for key in CHOICES}
    fewest = min_rows(capability)
    return {key: fewest[key] if kind == 'compiled' else None for key, kind in choose(capability).items()}


_DTYPES = {torch.float16: 0, torch.bfloat16: 1}


DECODE_KERNELS = ('auto', 'cuda_cores', 'tensor_cores')


def paged_decode_attention(q, cache, block_tables, kv_seqlens, scale, max_kv_len, num_sms, order=None,
                           out=None, kernel: str = 'auto') -> Optional[torch.Tensor]:
    """DeviceOps.paged_decode_attention by the compiled kernel; None where it does not take the inputs.
    ``kernel``: ``auto`` runs the tensor-core kernel where it runs (sm80+, block size a multiple of 16),
    else the CUDA-core one; the others force one (for tests and benchmarks)."""
    mod = module()
    if mod is None or q.dtype not in _DTYPES or q.dim() != 3 or q.stride(-1) != 1:
        return None
    bsz, h, d = q.shape
    k, v = cache.k, cache.v
    hkv = k.shape[2]
    policy = cache.quant_policy
    if not mod.decode_attention_supports(_DTYPES[q.dtype], policy, d, h, hkv):
        return None
    if not (k.is_contiguous() and v.is_contiguous() and block_tables.dtype == torch.int32
            and block_tables.stride(-1) == 1 and kv_seqlens.dtype == torch.int64 and kv_seqlens.is_contiguous()):
        return None
    if policy == 0 and k.dtype != q.dtype:
        return None
    if policy and not (cache.k_scale_zero.is_contiguous() and cache.v_scale_zero.is_contiguous()):
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
                               k.shape[1], splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                               block_tables.stride(0), float(scale), torch.cuda.current_stream(q.device).cuda_stream,
                               DECODE_KERNELS.index(kernel))
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
    if any(x.stride(-1) != 1 for x in (q, k, v)) or not (cache.k.is_contiguous() and cache.v.is_contiguous()):
        return None
    if policy == 0 and cache.k.dtype != q.dtype:
        return None
    if policy and not (cache.k_scale_zero.is_contiguous() and cache.v_scale_zero.is_contiguous()):
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
                       slots.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), ksz, vsz, _DTYPES[q.dtype], policy,
                       int(rotates_k(policy, d)), t, h, hkv, d, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                       v.stride(0), v.stride(1), cos.stride(0), torch.cuda.current_stream(q.device).cuda_stream)
    return out[:, :h], out[:, h:]
