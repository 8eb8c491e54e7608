"""Huawei Ascend NPUs (Atlas 800T A2 / 910B) through torch_npu's fused inference ops.

Which torch_npu op serves which interface entry, and the documentation each op's arguments come from, is
in README.md next to this file. GEMMs and embeddings are torch's (torch_npu implements aten on the NPU);
sampling is the reference's plain torch, run on the NPU's tensors (no host round trip per request).

Not run on hardware yet: verified against tests/npu_emulation, a plain-torch emulation of exactly the
torch_npu functions called here, written from their documentation.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..cache import KVCache, KVCacheSpec, quantize
from ..interface import DeviceOps
from ..reference import ReferenceOps, ReferenceSampling
from . import runtime
from .w4a16 import W4A16_IMPLS

# sparse_mode 3 ("rightDownCausal") reads a fixed 2048 x 2048 upper-triangular mask (True: masked) and
# aligns it to the bottom right of each sequence's (q, kv) square: query row i of q_len new tokens sees
# context positions up to kv_len - q_len + i, the interface's causal rule with a cached prefix
_CAUSAL_MASK_SIZE = 2048
_RIGHT_DOWN_CAUSAL = 3

# quant_policy 8 (README.md): the fused attention's antiquant mode 5, "per-token and per-head, scale / offset
# managed as page attention": int8 K / V blocks, float32 scale and offset [N, Hkv, S], dequantized as
# (x + offset) * scale. lmdeploy's codes c in [0, 255] are stored as c - 128, with offset 128 + zero / scale:
# (c - 128 + offset) * scale = c * scale + zero, the definition (devices/cache.py)
_PER_TOKEN_HEAD_PAGED = 5
_INT8_SHIFT = 128
_REFERENCE = ReferenceOps()  # plain torch on any device's tensors: windows and soft caps (below)


class AscendOps(ReferenceSampling, DeviceOps):
    name = 'ascend'
    runtime_class = runtime.AscendRuntime  # NPU memory, events, graphs of decode steps, HCCL (runtime.py)
    quant_policies = (0, 8)
    layer_impls = W4A16_IMPLS  # AWQ / GPTQ through npu_weight_quant_batchmatmul (w4a16.py)

    def __init__(self):
        self._npu_ops = runtime.torch_npu()
        self._mask = None
        self._host_lens = (None, None)  # (tensor, its values as a host list): one read a step
        # kv lengths seen by attention while the runtime records a graph (runtime.AscendRuntime.capture_graph)
        self._recording: Optional[List[torch.Tensor]] = None

    def default_dtype(self, config_dtype: torch.dtype) -> torch.dtype:
        # the fused attention ops take FLOAT16 / BFLOAT16 queries; the 910B runs bf16
        return torch.bfloat16 if config_dtype == torch.float32 else config_dtype

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        # float32 is accepted for exact comparisons under the emulation; the fused attention's documentation
        # lists FLOAT16 / BFLOAT16 (and INT8) queries only, so on hardware run bf16 or fp16
        return dtype in (torch.float16, torch.bfloat16, torch.float32)

    def kv_cache_spec(self, num_kv_heads, head_dim, block_size, dtype, quant_policy=0) -> KVCacheSpec:
        """quant_policy 0: the standard layout. 8: int8 K / V ``[S, Hkv, D]`` per block and, apart, float32
        ``k_scale`` / ``k_offset`` / ``v_scale`` / ``v_offset`` ``[Hkv, S]`` per block (so each is the
        ``(blocknum, N, blocksize)`` tensor the fused attention's antiquant mode 5 reads). 4 is refused."""
        if quant_policy == 4:
            raise ValueError(f"device {self.name!r} does not implement quant_policy=4 (int4 KV cache): "
                             "torch_npu's fused attention documents int4 KV only as int32-packed values with "
                             "per-channel / per-token scales, not with page-managed per-token-and-head ones, and "
                             f"not for prompts over a paged cache; it implements {list(self.quant_policies)} "
                             "(quant_policy=8: int8 KV cache)")
        if quant_policy != 8:
            return super().kv_cache_spec(num_kv_heads, head_dim, block_size, dtype, quant_policy)
        codes = (block_size, num_kv_heads, head_dim)
        per_token = (num_kv_heads, block_size)
        tensors = (('k', codes, torch.int8), ('v', codes, torch.int8)) + tuple(
            (f'{x}_{part}', per_token, torch.float32) for x in 'kv' for part in ('scale', 'offset'))
        return KVCacheSpec(num_kv_heads, head_dim, block_size, dtype, quant_policy, tensors)

    # -------------------------------------------------------------- dense ops
    def embedding(self, ids, weight):
        return torch.nn.functional.embedding(ids, weight)

    def linear(self, x, weight, bias=None):
        return torch.nn.functional.linear(x, weight, bias)

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is None:
            return self._npu_ops.npu_rms_norm(x, weight, epsilon=eps)[0], None
        y, _, h = self._npu_ops.npu_add_rms_norm(x, residual, weight, epsilon=eps)
        return y, h

    def apply_rotary(self, q, k, cos, sin):
        # npu_rotary_mul, rotary_mode 'half': x * r1 + rotate_half(x) * r2 over BSND [1, T, H, D], with
        # r1 / r2 broadcast [1, T, 1, D] in x's dtype
        c = cos[None, :, None, :].to(q.dtype)
        s = sin[None, :, None, :].to(q.dtype)
        rotate = self._npu_ops.npu_rotary_mul
        return rotate(q[None], c, s)[0], rotate(k[None], c.to(k.dtype), s.to(k.dtype))[0]

    def silu_and_mul(self, x):
        return self._npu_ops.npu_swiglu(x, dim=-1)

    def gelu_tanh_and_mul(self, x):
        # composed from torch ops on the NPU tensors (the reference's definition): torch_npu's own gelu
        # (npu_gelu with approximate='tanh') is not in the emulation the tests run, so it stays untried here
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate='tanh') * up

    def gelu(self, x, approximate='none'):
        # npu_gelu, not torch's gelu: on the NPU torch's own ignores ``approximate`` (always tanh), as
        # npu_gelu's page says
        return self._npu_ops.npu_gelu(x, approximate=approximate)

    def layer_norm(self, x, weight, bias, eps):
        # torch's layer_norm (torch_npu's aten kernel; npu_layer_norm_eval's page says it is to be dropped for it)
        return _REFERENCE.layer_norm(x, weight, bias, eps)

    def quantize_per_token(self, x, fp8):
        # the reference's torch ops on the NPU tensors: no 8-bit layer runs here yet (W8A8 is not on Ascend's
        # list), so torch_npu's npu_dynamic_quant stays untried
        return _REFERENCE.quantize_per_token(x, fp8)

    # ------------------------------------------------------------- attention
    def fill_kv_cache(self, k, v, cache, slot_mapping):
        """npu_scatter_nd_update_ into the cache viewed as one row per slot. Padding rows (slot < 0) are
        sent, with their values, to the row of the largest slot (a real one whenever the step has one): a
        repeated identical write, so the shapes stay static for graphs and no host sync filters them.
        quant_policy 8: each row quantized as devices/cache.py defines it (plain torch ops), its codes written
        as int8 rows, its scale and offset into [N, Hkv, S] at (block, head, offset) index triples."""
        scatter = self._npu_ops.npu_scatter_nd_update_
        slots = slot_mapping.to(torch.int64)
        valid = slots >= 0
        first = slots.argmax()
        target = torch.where(valid, slots, slots[first].clamp(min=0))
        at = None
        for name, x, data in (('k', k, cache.k), ('v', v, cache.v)):
            rows = torch.where(valid[:, None, None], x, x[first])
            if cache.quant_policy == 0:
                scatter(data.view(-1, *data.shape[2:]), target[:, None], rows.to(data.dtype))
                continue
            codes, scale_zero = quantize(rows, 8)
            scale = scale_zero[..., 0].float()
            offset = scale_zero[..., 1].float() / scale + _INT8_SHIFT
            signed = (codes.to(torch.int32) - _INT8_SHIFT).to(torch.int8)
            scatter(data.view(-1, *data.shape[2:]), target[:, None], signed)
            if at is None:  # [T, Hkv, 3]: (block, head, offset in block) of every token and head
                s, hkv = data.shape[1], data.shape[2]
                heads = torch.arange(hkv, device=slots.device)[None, :].expand(slots.shape[0], hkv)
                at = torch.stack([(target // s)[:, None].expand_as(heads), heads,
                                  (target % s)[:, None].expand_as(heads)], dim=-1)
            scatter(cache.extra[f'{name}_scale'], at, scale)
            scatter(cache.extra[f'{name}_offset'], at, offset)

    def _causal_mask(self, device):
        if self._mask is None or self._mask.device != device:
            ones = torch.ones(_CAUSAL_MASK_SIZE, _CAUSAL_MASK_SIZE, dtype=torch.bool, device=device)
            self._mask = torch.triu(ones, diagonal=1)
        return self._mask

    def _fused_attention(self, q, cache, block_tables, q_ends: List[int], kv_lens: List[int], scale):
        """npu_fused_infer_attention_score over the paged cache: q TND [T, H, D] packed from row 0
        (``q_ends``: cumulative query lengths), each sequence's context ``kv_lens`` tokens read through
        ``block_tables`` from blocks [N, S, Hkv * D] (the standard layout's memory, viewed)."""
        n, s, hkv, d = cache.k.shape
        out, _ = self._npu_ops.npu_fused_infer_attention_score(
            q, cache.k.view(n, s, hkv * d), cache.v.view(n, s, hkv * d), atten_mask=self._causal_mask(q.device),
            actual_seq_lengths=q_ends, actual_seq_lengths_kv=kv_lens, block_table=block_tables.to(torch.int32),
            num_heads=q.shape[1], scale=scale, input_layout='TND', num_key_value_heads=hkv,
            sparse_mode=_RIGHT_DOWN_CAUSAL, block_size=s)
        return out

    def _fused_int8_decode(self, q, cache, block_tables, kv_lens: List[int], scale):
        """npu_fused_infer_attention_score over the int8 paged cache, one query per sequence: q BSND
        [B, 1, H, D] (Q_S = 1, the incremental branch, where the antiquant modes with page attention are
        documented), blocks [N, S, Hkv * D] int8, key / value antiquant mode 5 with the cache's float32
        scale / offset [N, Hkv, S]. No mask: a decode row sees its whole context."""
        n, s, hkv, d = cache.k.shape
        extra = cache.extra
        out, _ = self._npu_ops.npu_fused_infer_attention_score(
            q[:, None], cache.k.view(n, s, hkv * d), cache.v.view(n, s, hkv * d), actual_seq_lengths_kv=kv_lens,
            block_table=block_tables.to(torch.int32), num_heads=q.shape[1], scale=scale, input_layout='BSND',
            num_key_value_heads=hkv, block_size=s, key_antiquant_scale=extra['k_scale'],
            key_antiquant_offset=extra['k_offset'], value_antiquant_scale=extra['v_scale'],
            value_antiquant_offset=extra['v_offset'], key_antiquant_mode=_PER_TOKEN_HEAD_PAGED,
            value_antiquant_mode=_PER_TOKEN_HEAD_PAGED)
        return out[:, 0]

    @staticmethod
    def _dequantized_blocks(cache, block_tables, kv_lens: List[int], dtype):
        """The int8 cache's blocks that these sequences' contexts occupy, dequantized ((x + offset) * scale,
        the op's formula) into a temporary cache of ``dtype``, and a block table into it: what a prompt step
        attends over, as the fused attention documents no antiquant with page attention for Q_S > 1. Its size
        is the step's own contexts (blocks of a shared prefix once per sequence), never the whole cache."""
        s = cache.block_size
        counts = [-(-n // s) for n in kv_lens]
        blocks = torch.cat([block_tables[b, :c] for b, c in enumerate(counts)]).long()
        tables = torch.zeros(len(counts), max(counts), dtype=torch.int32)
        start = 0
        for b, c in enumerate(counts):
            tables[b, :c] = torch.arange(start, start + c, dtype=torch.int32)
            start += c

        def read(name):
            codes = getattr(cache, name)[blocks].float()  # [M, S, Hkv, D]
            scale = cache.extra[f'{name}_scale'][blocks].transpose(1, 2)[..., None]  # [M, S, Hkv, 1]
            offset = cache.extra[f'{name}_offset'][blocks].transpose(1, 2)[..., None]
            return ((codes + offset) * scale).to(dtype)
        return KVCache(read('k'), read('v')), tables.to(block_tables.device)

    def _kv_lens_host(self, kv_seqlens: torch.Tensor) -> List[int]:
        """The context lengths as the host list the fused op takes, read once per eager step (every layer
        gets the same memory, each step new memory); an empty padding row reads one token, its output is
        zeroed after. While a graph is recorded nothing is read (a host read cannot be recorded): the
        recording gets one token per row, and every replay updates the lists (capture_graph)."""
        if self._recording is not None:
            return [1] * kv_seqlens.shape[0]
        key = (kv_seqlens.data_ptr(), kv_seqlens.shape, kv_seqlens.stride())
        held, values = self._host_lens
        if held is None or key != (held.data_ptr(), held.shape, held.stride()):
            values = kv_seqlens.clamp(min=1).tolist()
            self._host_lens = (kv_seqlens, values)  # held: no other tensor takes its memory meanwhile
        return values

    def _composed(self, cache, block_tables, kv_seqlens, dtype):
        """The cache in the standard layout (int8: the step's blocks dequantized) and its tables: what the
        reference's plain-torch attention reads, on the NPU's tensors."""
        if cache.quant_policy != 8:
            return cache, block_tables
        return self._dequantized_blocks(cache, block_tables, kv_seqlens.clamp(min=1).tolist(), dtype)

    def paged_prefill_attention(self, q, cache, block_tables, q_start_loc, q_seqlens, kv_seqlens, scale, max_q_len,
                                max_kv_len, out=None, sliding_window=None, logit_softcap=None, alibi_slopes=None):
        if sliding_window is not None or logit_softcap is not None or alibi_slopes is not None:
            # the fused attention documents no soft cap, its band mode (sparse_mode 4) is not in the emulation
            # the tests run, and an ALiBi bias would be a dense [H, Q, L] mask: the reference's composition of
            # torch ops, on the NPU
            std, tables = self._composed(cache, block_tables, kv_seqlens, q.dtype)
            return _REFERENCE.paged_prefill_attention(q, std, tables, q_start_loc, q_seqlens, kv_seqlens, scale,
                                                      max_q_len, max_kv_len, out, sliding_window, logit_softcap,
                                                      alibi_slopes)
        out = torch.empty_like(q) if out is None else out
        starts, q_lens, kv_lens = q_start_loc.tolist(), q_seqlens.tolist(), kv_seqlens.tolist()
        keep = [b for b, n in enumerate(q_lens) if n > 0]  # empty sequences own no rows
        if not keep:
            return out
        first, last = starts[keep[0]], starts[keep[-1]] + q_lens[keep[-1]]
        ends, total = [], 0
        for b in keep:
            total += q_lens[b]
            ends.append(total)
        rows = q[first:last]
        if total != last - first:  # rows between the sequences (not owned): pack the owned ones
            rows = torch.cat([q[starts[b]:starts[b] + q_lens[b]] for b in keep])
        tables = block_tables[keep] if len(keep) != len(q_lens) else block_tables
        kv_lens = [kv_lens[b] for b in keep]
        if cache.quant_policy == 8:
            cache, tables = self._dequantized_blocks(cache, tables, kv_lens, q.dtype)
        o = self._fused_attention(rows.contiguous(), cache, tables, ends, kv_lens, scale)
        at = 0
        for b in keep:
            out[starts[b]:starts[b] + q_lens[b]] = o[at:at + q_lens[b]]
            at += q_lens[b]
        return out

    def paged_decode_attention(self, q, cache, block_tables, kv_seqlens, scale, max_kv_len, order=None, out=None,
                               sliding_window=None, logit_softcap=None, alibi_slopes=None):
        if sliding_window is not None or logit_softcap is not None or alibi_slopes is not None:  # (as the prefill)
            std, tables = self._composed(cache, block_tables, kv_seqlens, q.dtype)
            return _REFERENCE.paged_decode_attention(q, std, tables, kv_seqlens, scale, max_kv_len, None, out,
                                                     sliding_window, logit_softcap, alibi_slopes)
        if self._recording is not None:
            self._recording.append(kv_seqlens)
        batch = q.shape[0]
        if cache.quant_policy == 8:
            o = self._fused_int8_decode(q.contiguous(), cache, block_tables, self._kv_lens_host(kv_seqlens), scale)
        else:
            o = self._fused_attention(q.contiguous(), cache, block_tables, list(range(1, batch + 1)),
                                      self._kv_lens_host(kv_seqlens), scale)
        o = torch.where((kv_seqlens > 0)[:, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
        return o if out is None else out.copy_(o)

    # -------------------------------------------------------------- sampling (the rest: ReferenceSampling)
    def argmax(self, logits):
        return logits.argmax(dim=-1)
