"""The reference: every op in plain torch, the executable definition of what it means.

Written for clarity first, on any torch device. The cpu device is this
reference with the cpu's services; other devices are tested against it
(devices/conformance.py) and may reuse pieces of it (the cuda device's
sampling ops are these).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import rng
from .act_quant import quantize_input
from .cache import KVCache, dequantize, hadamard, pack_int4, quantize, rotates_k, unpack_int4
from .interface import DeviceOps


class ReferenceOps(DeviceOps):
    """Every op of :class:`DeviceOps`, in plain torch; no services."""
    quant_policies = (0, 4, 8)

    # -------------------------------------------------------------- dense ops
    def embedding(self, ids, weight):
        return F.embedding(ids, weight)

    def linear(self, x, weight, bias=None):
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype), (x if residual is not None else None)

    def apply_rotary(self, q, k, cos, sin):

        def rotate(x):
            c = cos[:, None, :].to(x.dtype)
            s = sin[:, None, :].to(x.dtype)
            x1, x2 = x.chunk(2, dim=-1)
            return x * c + torch.cat((-x2, x1), dim=-1) * s

        return rotate(q), rotate(k)

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate='tanh') * up

    def gelu(self, x, approximate='none'):
        return F.gelu(x.float(), approximate=approximate).to(x.dtype)

    def layer_norm(self, x, weight, bias, eps):
        return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)

    # ------------------------------------------------ quantized activations
    def quantize_per_token(self, x, fp8):
        return quantize_input(x, fp8)

    # ------------------------------------------------------------- attention
    def fill_kv_cache(self, k, v, cache: KVCache, slot_mapping):
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        at = (slots // cache.block_size, slots % cache.block_size)  # (block, offset): whatever order stores them
        for x, data, scale_zero in ((k, cache.k, cache.k_scale_zero), (v, cache.v, cache.v_scale_zero)):
            rows = x[keep]
            if cache.quant_policy == 0:
                data[at] = rows.to(data.dtype)
                continue
            if x is k and rotates_k(cache.quant_policy, rows.shape[-1]):
                rows = rows.float() @ hadamard(rows.shape[-1], rows.device)
            if x is k and cache.k_mean is not None:
                rows = rows.float() - cache.k_mean
            codes, sz = quantize(rows, cache.quant_policy)
            data[at] = codes if cache.quant_policy == 8 else pack_int4(codes)
            scale_zero[at] = sz

    @staticmethod
    def _read(cache: KVCache, which: str, blocks: torch.Tensor) -> torch.Tensor:
        """K or V of the given blocks ([..., S, Hkv, D] for blocks [...]): as stored, or dequantized (float32)."""
        data = getattr(cache, which)[blocks]
        if cache.quant_policy == 0:
            return data
        codes = data if cache.quant_policy == 8 else unpack_int4(data)
        return dequantize(codes, getattr(cache, f'{which}_scale_zero')[blocks])

    def _gather_context(self, cache: KVCache, which: str, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """The first ``length`` tokens' K or V of one sequence: [length, Hkv, D] (a freed block's, -1 in the
        table, read from block 0: garbage the caller zeroes)."""
        n = (length + cache.block_size - 1) // cache.block_size
        return self._read(cache, which, block_table[:n].long().clamp(min=0)).flatten(0, 1)[:length]

    @staticmethod
    def _attend(q, k, v, scale, allowed, cache: KVCache, logit_softcap=None, bias=None):
        """q [B, H, Q, D], k/v [B, Hkv, L, D], allowed [B, 1, Q, L] bool; ``bias`` (optional, float32, broadcast
        to [B, H, Q, L]) added to the scores (ALiBi). Math in float32; GQA by sharing each KV head across its
        query group; q rotated as the cache's K is (devices/cache.py). Soft-capped scores are written out
        (SDPA has no cap); the cap is not blind to a shift of every score, so int4's centred keys get their
        mean back first."""
        qf = q.float()
        if rotates_k(cache.quant_policy, q.shape[-1]):
            qf = qf @ hadamard(q.shape[-1], q.device)
        if logit_softcap is None:
            mask = allowed if bias is None else bias.masked_fill(~allowed, float('-inf'))
            out = F.scaled_dot_product_attention(qf, k.float(), v.float(), attn_mask=mask, scale=scale,
                                                 enable_gqa=True)
            return (out if bias is None else torch.nan_to_num(out)).to(q.dtype)
        group = q.shape[1] // k.shape[1]
        if cache.k_mean is not None:
            k = k.float() + cache.k_mean[None, :, None, :]
        kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        s = (qf @ kf.transpose(-1, -2)) * scale
        s = torch.tanh(s / logit_softcap) * logit_softcap
        if bias is not None:
            s = s + bias
        p = s.masked_fill(~allowed, float('-inf')).softmax(-1)
        return torch.nan_to_num(p @ vf).to(q.dtype)  # (a row that sees nothing: a padding row)

    @staticmethod
    def _alibi(slopes, q_pos, kv_len):
        """[H, Q, L] float32: slope_h * (j - p) for query positions ``q_pos`` [Q] (or [B, Q]: [B, H, Q, L])."""
        if slopes is None:
            return None
        j = torch.arange(kv_len, device=q_pos.device, dtype=torch.float32)
        dist = j - q_pos.float()[..., None]  # [..., Q, L]
        return slopes.float().view(-1, 1, 1) * dist.unsqueeze(-3)

    @staticmethod
    def _visible(q_pos, kv_len, sliding_window):
        """[Q, L] bool: context position j is visible to the query at q_pos (causal, within the window)."""
        j = torch.arange(kv_len, device=q_pos.device)[None, :]
        allowed = j <= q_pos[:, None]
        if sliding_window is not None:
            allowed &= j > q_pos[:, None] - sliding_window
        return allowed

    def paged_prefill_attention(self, q, cache, block_tables, q_start_loc, q_seqlens, kv_seqlens, scale, max_q_len,
                                max_kv_len, out=None, sliding_window=None, logit_softcap=None, alibi_slopes=None):
        out = torch.empty_like(q) if out is None else out
        for b, (start, qlen, kvlen) in enumerate(zip(q_start_loc.tolist(), q_seqlens.tolist(), kv_seqlens.tolist())):
            if qlen == 0:
                continue
            k = self._gather_context(cache, 'k', block_tables[b], kvlen)
            v = self._gather_context(cache, 'v', block_tables[b], kvlen)
            if sliding_window is not None:  # what no row sees (its block may be freed) never reaches the output
                unseen = max(0, kvlen - qlen - sliding_window + 1)
                k, v = k.clone(), v.clone()
                k[:unseen] = 0
                v[:unseen] = 0
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            # query row i sits at position kvlen - qlen + i and sees positions <= it (within the window)
            q_pos = torch.arange(kvlen - qlen, kvlen, device=q.device)
            allowed = self._visible(q_pos, kvlen, sliding_window)
            bias = self._alibi(alibi_slopes, q_pos, kvlen)
            o = self._attend(q[start:start + qlen].transpose(0, 1)[None], k, v, scale, allowed[None, None], cache,
                             logit_softcap, None if bias is None else bias[None])
            out[start:start + qlen] = o[0].transpose(0, 1)
        return out

    def paged_decode_attention(self, q, cache, block_tables, kv_seqlens, scale, max_kv_len, order=None, out=None,
                               sliding_window=None, logit_softcap=None, alibi_slopes=None):
        """Batched over sequences: gather every block in the tables, mask the
        tail. All rows at once, so ``order`` changes nothing here."""
        n = (max_kv_len + cache.block_size - 1) // cache.block_size
        tables = block_tables[:, :n].long().clamp(min=0)  # (-1: a block freed behind a sliding window)
        k = self._read(cache, 'k', tables).flatten(1, 2)  # [B, L, Hkv, D]
        v = self._read(cache, 'v', tables).flatten(1, 2)
        j = torch.arange(k.shape[1], device=q.device)[None, :]
        valid = j < kv_seqlens[:, None]  # [B, L]
        # the query sits at kv_seqlens - 1: its window is the last sliding_window tokens
        seen = valid if sliding_window is None else valid & (j >= kv_seqlens[:, None] - sliding_window)
        # never let unwritten (possibly NaN) or freed cache memory reach the output
        zero = torch.zeros((), dtype=v.dtype, device=v.device)
        k = torch.where(seen[:, :, None, None], k, zero)
        v = torch.where(seen[:, :, None, None], v, zero)
        bias = self._alibi(alibi_slopes, (kv_seqlens - 1)[:, None], k.shape[1])  # [B, H, 1, L]
        o = self._attend(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), scale, seen[:, None, None, :],
                         cache, logit_softcap, bias)[:, :, 0]
        o = torch.where((kv_seqlens > 0)[:, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
        return o if out is None else out.copy_(o)

    # -------------------------------------------------------------- sampling
    def apply_repetition_penalty(self, logits, token_ids, penalty):
        bsz, vocab = logits.shape
        # column 0 collects the -1 padding and is dropped
        seen = torch.zeros(bsz, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, token_ids + 1, True)
        seen = seen[:, 1:]
        p = penalty[:, None].to(logits.dtype)
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits.copy_(torch.where(seen, penalised, logits))
        return logits

    def apply_frequency_presence_penalty(self, logits, token_ids, frequency, presence):
        # sparse: only the generated ids' scores are read and written (a row has far fewer ids than the
        # vocabulary). Sorted, each id's repeats form a run; every position writes its id's new score, so
        # repeats write the same value and the scatter needs no atomics.
        ids, _ = token_ids.sort(dim=1)  # padding (-1) first, the row's largest id last
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        first = torch.ones_like(ids, dtype=torch.bool)
        first[:, 1:] = ids[:, 1:] != ids[:, :-1]
        last = torch.ones_like(first)
        last[:, :-1] = first[:, 1:]
        run_first = torch.where(first, pos, 0).cummax(dim=1).values
        run_last = torch.where(last, pos, ids.shape[1]).flip(1).cummin(dim=1).values.flip(1)
        counts = (run_last - run_first + 1).to(logits.dtype)
        valid = ids >= 0
        cols = torch.where(valid, ids, ids[:, -1:].clamp(min=0))  # padding points at a real id (or 0: none)
        new = logits.gather(1, cols) - (counts * frequency[:, None].to(logits.dtype)
                                         + presence[:, None].to(logits.dtype))
        # padding writes what its column gets anyway: the row's largest id's new score, or (no id) column 0 as is
        keep = torch.where(ids[:, -1:] >= 0, new[:, -1:], logits[:, :1])
        logits.scatter_(1, cols, torch.where(valid, new, keep))
        return logits

    def apply_token_bitmask(self, logits, bitmask):
        # byte k of word w (little-endian) holds tokens 32 w + 8 k .. + 7: unpacked through a table of the
        # 256 bytes' bits
        table = torch.arange(256, device=logits.device)[:, None] >> torch.arange(8, device=logits.device) & 1
        as_bytes = bitmask.to(logits.device).contiguous().view(torch.uint8).long()  # [B, 4 W]
        allowed = table.bool()[as_bytes].flatten(1)[:, :logits.shape[-1]]
        return logits.masked_fill(~allowed, float('-inf'))

    def apply_temperature(self, logits, temperature):
        return logits / temperature.reshape(-1, 1).to(logits.dtype)

    def top_k_top_p_min_p(self, logits, top_k, top_p, min_p, max_top_k=None):
        logits = logits.clone()
        neg_inf = float('-inf')
        vocab = logits.shape[-1]
        # top-k: keep values >= the k-th largest (the largest k of all rows found without sorting the vocabulary)
        if top_k is not None:
            k = top_k.to(torch.int64).clamp(min=0, max=vocab)
            widest = min(vocab, max(1, max_top_k if max_top_k is not None else int(k.max())))
            largest = logits.topk(widest, dim=-1).values  # descending
            kth = largest.gather(1, (k - 1).clamp(min=0, max=widest - 1)[:, None])
            logits.masked_fill_((k > 0)[:, None] & (logits < kth), neg_inf)
        # top-p: drop a token once the mass of the tokens before it reaches top_p
        if top_p is not None:
            probs = logits.float().softmax(dim=-1)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # exclusive prefix sum (cumsum - probs rounds, missing exact boundaries)
            cum = sorted_probs.cumsum(dim=-1)
            mass_before = torch.cat((torch.zeros_like(cum[:, :1]), cum[:, :-1]), dim=-1)
            drop_sorted = mass_before >= top_p[:, None].float()
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            logits.masked_fill_((top_p < 1.0)[:, None] & drop, neg_inf)
        # min-p: relative to the most likely survivor
        if min_p is not None:
            probs = logits.float().softmax(dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None].float()
            logits.masked_fill_((min_p > 0.0)[:, None] & (probs < threshold), neg_inf)
        return logits

    def sample(self, logits, seeds, offsets):
        probs = logits.float().softmax(dim=-1)
        race = -torch.log(rng.uniform(seeds, offsets, logits.shape[-1]))
        return (probs / race).argmax(dim=-1)


class ReferenceSampling:
    """The reference's sampling ops for other devices: plain torch that runs on the logits' own device (no
    host round trip per request). A device without faster ones of its own lists this before DeviceOps."""
    apply_repetition_penalty = ReferenceOps.apply_repetition_penalty
    apply_frequency_presence_penalty = ReferenceOps.apply_frequency_presence_penalty
    apply_token_bitmask = ReferenceOps.apply_token_bitmask
    apply_temperature = ReferenceOps.apply_temperature
    top_k_top_p_min_p = ReferenceOps.top_k_top_p_min_p
    sample = ReferenceOps.sample
