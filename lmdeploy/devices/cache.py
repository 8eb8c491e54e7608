"""One layer's paged KV cache, laid out by its device, and what quantizing it means.

The engine never shapes a cache: it asks the device for a
:class:`KVCacheSpec` (``DeviceOps.kv_cache_spec``), sizes the cache from
``bytes_per_block``, and hands each layer's :class:`KVCache` to the cache
and attention ops.

Token ``j`` of a sequence lives in block ``block_tables[b, j // S]`` at
offset ``j % S``; its "slot" is ``block * S + offset``. The standard layout
(the reference's, and the cuda device's): per block ``[S, Hkv, D]`` of K and
of V in the model's dtype (``quant_policy`` 0), or

* ``quant_policy`` 8: K and V as uint8 ``[S, Hkv, D]``,
* ``quant_policy`` 4: K and V as uint8 ``[S, Hkv, D / 2]``, the byte at ``j``
  holding element ``j`` in its low four bits and ``j + D / 2`` in its high
  four,

each with ``[S, Hkv, 2]`` float16 (scale, zero) of every token's K (and V)
per KV head: asymmetric, online (computed when the token is written),
``x ~ q * scale + zero`` with ``q`` in ``[0, 2**bits - 1]``
(:func:`quantize` and :func:`dequantize` are the definition).

Those shapes are the cache's meaning; where its bytes lie is the device's
choice. A spec may store each block head-major (``KVCacheSpec.head_major``:
``[Hkv, S, ...]`` in memory, each KV head's tokens one run of bytes), and its
:class:`KVCache` then holds views in the order above (``[N, S, Hkv, ...]``,
strided), so that code indexing them means the same whatever the order. The
cuda device stores its quantized caches so: an int4 row is 64 bytes (head_dim
128), and 16 rows 512 bytes apart, as token-major blocks of 8 KV heads lay a
head's tokens, read at two thirds of the speed of 16 rows in a row (H100,
decode attention).

With ``quant_policy`` 4 and a power-of-two head_dim of at least 32, K is
stored rotated, ``k @ H`` (:func:`hadamard`), and attention rotates q the same
way: ``(q H) . (k H) = q . k`` as H is orthonormal. The rotation spreads K's
few outlier channels over all of them, so 16 levels a token cover a
narrower range (SmolLM2-135M perplexity: +16.6 % unrotated, +7.1 %
rotated; V has no such outliers and rotating it gained nothing).

With ``quant_policy`` 4, K is also stored centred: less the layer's mean
key ``m`` per KV head (``KVCache.k_mean``, in the basis K is stored in), so
the codes are those of ``k H - m``. Attention needs no correction: ``q . (k
- b)`` is ``q . k`` less ``q . b``, the same for every key a query sees, and
softmax does not change when all of a query's scores move together. ``m`` is
the mean key of :data:`KEY_MEAN_TOKENS` random tokens run through the model
once at start-up (the engine's ``mean_keys``): the part of K that every
token shares, on which per-token ranges would otherwise spend their 16
levels (SmolLM2-135M perplexity: +7.1 % uncentred, +4.0 % centred).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

QUANT_POLICIES = (0, 4, 8)
KEY_MEAN_TOKENS = 2048  # random tokens whose mean key int4 takes off each layer's keys
SCALE_DTYPE = torch.float16  # of (scale, zero): 11 significant bits, so rounding them costs less than a step


@dataclass(frozen=True)
class KVCacheSpec:
    """How one layer's cache is laid out: per-block shapes and dtypes of its named tensors."""
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's K/V dtype (what attention reads them as)
    quant_policy: int
    tensors: Tuple[Tuple[str, Tuple[int, ...], torch.dtype], ...]  # (name, shape of one block, dtype)
    head_major: bool = False  # blocks stored [Hkv, S, ...] (the module docstring); the views are [S, Hkv, ...]

    @property
    def bytes_per_block(self) -> int:
        return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for _, shape, dt in self.tensors)

    @property
    def centres_keys(self) -> bool:
        """Whether K is stored less the layer's mean key (the module docstring), which the engine
        measures once at start-up and hands to each layer's cache (:meth:`KVCache.set_key_mean`)."""
        return centres_keys(self.quant_policy)

    def allocate(self, num_blocks: int, device) -> 'KVCache':
        made = {name: self._empty(num_blocks, shape, dt, device) for name, shape, dt in self.tensors}
        return KVCache(made.pop('k'), made.pop('v'), self.quant_policy, made.pop('k_scale_zero', None),
                       made.pop('v_scale_zero', None), made)

    def _empty(self, num_blocks: int, shape: Tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        if not self.head_major:
            return torch.empty((num_blocks, *shape), dtype=dtype, device=device)
        tokens, heads, *rest = shape
        return torch.empty((num_blocks, heads, tokens, *rest), dtype=dtype, device=device).transpose(1, 2)


def standard_spec(num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                  quant_policy: int = 0, head_major: bool = False) -> KVCacheSpec:
    """The layout this module's docstring describes (``head_major``: stored so, as views)."""
    if quant_policy not in QUANT_POLICIES:
        raise ValueError(f'quant_policy must be one of {QUANT_POLICIES}, got {quant_policy!r}')
    block = (block_size, num_kv_heads)
    if quant_policy == 0:
        tensors = (('k', (*block, head_dim), dtype), ('v', (*block, head_dim), dtype))
    else:
        if quant_policy == 4 and head_dim % 2:
            raise ValueError(f'quant_policy=4 packs two values per byte: head_dim {head_dim} must be even')
        width = head_dim if quant_policy == 8 else head_dim // 2
        tensors = (('k', (*block, width), torch.uint8), ('v', (*block, width), torch.uint8),
                   ('k_scale_zero', (*block, 2), SCALE_DTYPE), ('v_scale_zero', (*block, 2), SCALE_DTYPE))
    return KVCacheSpec(num_kv_heads, head_dim, block_size, dtype, quant_policy, tensors, head_major)


@dataclass
class KVCache:
    """One layer's paged cache: ``k`` and ``v`` ``[N, S, Hkv, ...]`` and, when
    quantized in the standard layout, their per-token, per-head (scale, zero)
    ``[N, S, Hkv, 2]``. ``extra``: the tensors of a device's own layout under
    the names its spec gives them (e.g. the ascend device's int8 cache keeps
    scales and offsets apart, as its attention op reads them)."""
    k: torch.Tensor
    v: torch.Tensor
    quant_policy: int = 0
    k_scale_zero: Optional[torch.Tensor] = None
    v_scale_zero: Optional[torch.Tensor] = None
    extra: Dict[str, torch.Tensor] = field(default_factory=dict)
    # [Hkv, D] float32: subtracted from every key, in the basis K is stored in, before it is quantized
    k_mean: Optional[torch.Tensor] = None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def set_key_mean(self, mean_key: torch.Tensor) -> None:
        """The layer's mean key [Hkv, D] (after RoPE), kept in the basis K is stored in.
        Before any token is written: codes written before would not match."""
        if not centres_keys(self.quant_policy):
            raise ValueError(f'quant_policy {self.quant_policy} stores K uncentred')
        d = mean_key.shape[-1]
        mean = mean_key.float().to(self.k.device)
        if rotates_k(self.quant_policy, d):
            mean = mean @ hadamard(d, mean.device)
        self.k_mean = mean.contiguous()

    @functools.cached_property
    def rows(self) -> Tuple[int, int, int]:
        """:func:`row_strides` of this cache: its layout is fixed when it is allocated, so the ops that
        address it (every layer, every step) read it here instead of working it out again."""
        return row_strides(self.k, self.v, self.k_scale_zero, self.v_scale_zero)

    def tensors(self) -> Dict[str, torch.Tensor]:
        named = dict(k=self.k, v=self.v, k_scale_zero=self.k_scale_zero, v_scale_zero=self.v_scale_zero)
        return {**{k: t for k, t in named.items() if t is not None}, **self.extra}


def row_strides(k: torch.Tensor, v: torch.Tensor, k_scale_zero: Optional[torch.Tensor] = None,
                v_scale_zero: Optional[torch.Tensor] = None) -> Tuple[int, int, int]:
    """A cache's strides in rows, (block, offset in block, KV head), where a row is one token's codes of one
    head (the last dim) or its scale and zero: how kernels address any layout a spec allocates (token-major
    ``(S Hkv, Hkv, 1)``, head-major ``(Hkv S, 1, S)``). K, V and the scales must share them."""
    width = k.shape[-1]
    rows = tuple(s // width for s in k.stride()[:3])
    ok = (k.dim() == 4 and k.stride(-1) == 1 and v.stride() == k.stride()
          and all(r * width == s for r, s in zip(rows, k.stride()[:3])))
    if k_scale_zero is not None:
        ok = ok and all(z.stride() == (*(2 * r for r in rows), 1) for z in (k_scale_zero, v_scale_zero))
    if not ok:
        raise ValueError('a cache\'s K, V (and scales) must share one layout of whole rows: strides '
                         + ', '.join(str(x.stride()) for x in (k, v, k_scale_zero, v_scale_zero) if x is not None))
    return rows


# ------------------------------------------------------------- the definition
def rotates_k(quant_policy: int, head_dim: int) -> bool:
    """Whether K is stored in the Hadamard basis (see the module docstring)."""
    return quant_policy == 4 and head_dim >= 32 and head_dim & (head_dim - 1) == 0


def centres_keys(quant_policy: int) -> bool:
    """Whether K is stored less the layer's mean key (see the module docstring)."""
    return quant_policy == 4


@functools.lru_cache(maxsize=16)
def hadamard(d: int, device=None) -> torch.Tensor:
    """The normalised Sylvester-Hadamard matrix, float32 [d, d]: ``H[i, j] =
    (-1) ** popcount(i & j) / sqrt(d)``; symmetric and orthonormal (H H = I).
    Made once per (d, device) and shared: do not write to it."""
    i = torch.arange(d, device=device)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    for b in range(max(1, d.bit_length())):
        parity ^= (bits >> b) & 1
    return (1 - 2 * parity).float() / math.sqrt(d)


def quantize(x: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] (uint8, unpacked), scale_zero [..., 2] float16).

    Per row: zero = min, scale = (max - min) / (2**bits - 1), both rounded
    to float16 first; codes = round((x - zero) / scale) clamped to
    [0, 2**bits - 1] (computed in float32; a constant row gets scale 1 and
    codes 0)."""
    levels = (1 << bits) - 1
    xf = x.float()
    lo, hi = xf.amin(-1), xf.amax(-1)
    zero = lo.to(SCALE_DTYPE)
    scale = ((hi - lo) / levels).to(SCALE_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((xf - zero.float()[..., None]) / scale.float()[..., None]).clamp(0, levels)
    return codes.to(torch.uint8), torch.stack([scale, zero], dim=-1)


def dequantize(codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """codes [..., D] (unpacked), scale_zero [..., 2] -> float32 [..., D]."""
    sz = scale_zero.float()
    return codes.float() * sz[..., 0:1] + sz[..., 1:2]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes in [0, 15] -> [..., D / 2] bytes: element j low, j + D/2 high."""
    half = codes.shape[-1] // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 0xF, packed >> 4], dim=-1)
