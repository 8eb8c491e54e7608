"""The one list of ops the engine and the models use.

A device implements :class:`DeviceOps` (its kernels) and names its :class:`~.runtime.DeviceRuntime` (its
services). The reference (devices/reference.py,
the ``cpu`` device) is the executable specification: its plain-torch code
defines what every op means, and other devices are tested against it.

Shapes use these names:
    T  number of tokens in the step (all sequences packed, no padding)
    B  number of sequences in the step
    H / Hkv  query / key-value heads, D head dim, V vocab size
    N  number of KV blocks, S block size (tokens per block)

Paged KV cache: one :class:`~.cache.KVCache` per layer, laid out as the
device's :meth:`DeviceOps.kv_cache_spec` says (devices/cache.py: blocks of
``S`` tokens; token ``j`` of a sequence lives in block
``block_tables[b, j // S]`` at offset ``j % S``, its "slot" being
``block * S + offset``; quantized caches keep a scale and a zero per token
and KV head).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from .act_quant import QuantizedInput
from .cache import KVCache, KVCacheSpec, standard_spec
from .runtime import DeviceRuntime


class DeviceOps:
    """The ops (kernels) of one device kind. Subclasses override every op. The device's services (memory,
    synchronisation, timing, graph capture, process groups, availability, the engine's plan) are its
    runtime's (devices/runtime.py): ``runtime_class`` names it, ``self.runtime`` is this object's."""

    name: str = 'abstract'  # its device_type (the registry's key)
    runtime_class: type = DeviceRuntime  # the runtime this device's ops run on (devices/runtime.py)

    @property
    def runtime(self) -> DeviceRuntime:
        """This device's runtime, made on first use (it takes over the services a one-class device defines
        on its ops class: devices/runtime.py)."""
        runtime = self.__dict__.get('_runtime')
        if runtime is None:
            runtime = self._runtime = self.runtime_class(self)
        return runtime

    # the few services the ops' own callers (the layers, the conformance suite) reach through the ops: the
    # runtime's, forwarded
    @classmethod
    def is_available(cls) -> bool:
        """True if this process can run on the device (its runtime class says)."""
        return cls.runtime_class.is_available()

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """None where :meth:`is_available`; else why not (the runtime's words)."""
        if cls.is_available():
            return None
        return cls.runtime_class.unavailable_reason() or f'{cls.__name__}.is_available() is False here'

    def torch_device(self) -> torch.device:
        """Where this device's tensors live (its runtime's)."""
        return self.runtime.torch_device()

    def synchronize(self) -> None:
        """Wait until queued work on the device is done (its runtime's)."""
        self.runtime.synchronize()

    # ------------------------------------------------------------- dtypes
    def default_dtype(self, config_dtype: torch.dtype) -> torch.dtype:
        """dtype used for dtype='auto' given the checkpoint's dtype (one the ops compute in)."""
        return config_dtype

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """Whether the ops compute in ``dtype``."""
        return dtype in (torch.float16, torch.bfloat16)

    # ---------------------------------------------------------- cache layout
    # the layout the attention and fill kernels read: KV cache quantizations they implement (devices/cache.py)
    quant_policies: Tuple[int, ...] = (0, )

    def kv_cache_spec(self, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                      quant_policy: int = 0) -> KVCacheSpec:
        """How one layer's cache is laid out here. A policy the device lacks is
        refused (ValueError, at the engine's start-up)."""
        if quant_policy not in self.quant_policies:
            raise ValueError(f'device {self.name!r} does not implement quant_policy={quant_policy} (a quantized '
                             f'KV cache); it implements {list(self.quant_policies)}')
        return standard_spec(num_kv_heads, head_dim, block_size, dtype, quant_policy)

    def mean_key(self, cache: KVCache, num_tokens: int) -> torch.Tensor:
        """The mean key [Hkv, D] (float32) of slots 0 to ``num_tokens`` - 1 of an unquantized cache
        (quant_policy 0): how the engine measures what int4 takes off K (devices/cache.py). Read through the
        cache's views (the standard order, however the spec stores them); a device whose unquantized cache has
        other tensors overrides it."""
        return cache.k.flatten(0, 1)[:num_tokens].float().mean(0)

    # ------------------------------------------------- collectives in a step
    # under tensor parallelism the layers call these inside the model's forward (recorded with it); the
    # process group they run in is the runtime's (collective_backend)
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks: ``x`` itself summed in place, or a new tensor (callers use the
        returned one)."""
        import torch.distributed as dist
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (same shape on each), stacked in rank order: [world, *x.shape]."""
        import torch.distributed as dist
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.stack(parts)

    # ---------------------------------------------------------------- layers
    # (kind, weight format) -> this device's own implementation class (devices/layers.py); the others come
    # from the reference's, which runs over this device's ops
    layer_impls: Dict[Tuple[str, str], type] = {}

    def layer_impl(self, kind: str, weight_format: str, config: Optional[Dict[str, Any]] = None):
        """How this device runs a ``kind`` layer (``'linear'``) whose weights come in ``weight_format``
        (``'dense'``, ``'int8_channel'``, ``'awq'``, ...; ``config``: the checkpoint's quantization_config): an
        object that makes the layer's parameters, processes them once after loading and applies the layer
        (devices/layers.py)."""
        from .layers import REFERENCE_IMPLS
        cls = self.layer_impls.get((kind, weight_format)) or REFERENCE_IMPLS.get((kind, weight_format))
        if cls is None:
            raise ValueError(f'device {self.name!r} has no {kind} layer for {weight_format!r} weights')
        return cls(self, config) if config else cls(self)

    # -------------------------------------------------------------- dense ops
    def embedding(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """ids [T] -> weight[ids] [T, hidden]."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, in] @ weight[out, in].T + bias -> [T, out] (a plain weight; other formats are layer
        implementations: :meth:`layer_impl`)."""
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """RMSNorm with an optional fused residual add.

        Without residual: returns (weight * x / rms(x), None).
        With residual: h = x + residual; returns (weight * h / rms(h), h).
        The mean of squares is taken in float32; the result is cast back to
        x's dtype before the weight multiply (as transformers' Llama does).
        """
        raise NotImplementedError

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding, "rotate half" layout.

        q [T, H, D], k [T, Hkv, D], cos/sin [T, D] (both halves repeated).
        out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
        Returns new tensors of q's / k's dtype.
        """
        raise NotImplementedError

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] = cat(gate, up) -> silu(gate) * up [T, I]."""
        raise NotImplementedError

    def linear_silu_and_mul(self, x: torch.Tensor, weight: torch.Tensor,
                            bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """silu_and_mul(linear(x, weight, bias)), weight = cat(W_gate, W_up):
        the gated MLP's first half. A device may fuse the two (each output
        column then needs its gate and up rows in one program)."""
        return self.silu_and_mul(self.linear(x, weight, bias))

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] = cat(gate, up) -> gelu_tanh(gate) * up [T, I], in x's dtype, where
        gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) is torch's
        ``F.gelu(g, approximate='tanh')`` (transformers' ``gelu_pytorch_tanh``: Gemma's MLP),
        rounded to x's dtype before the product as ``F.gelu(gate, approximate='tanh') * up`` is."""
        raise NotImplementedError

    def gelu(self, x: torch.Tensor, approximate: str = 'none') -> torch.Tensor:
        """x [T, I] -> gelu(x) [T, I] elementwise, in x's dtype (an MLP without a gate: StarCoder2, Falcon).
        ``approximate`` 'none': x * (1 + erf(x / sqrt(2))) / 2 (transformers' ``gelu``); 'tanh':
        0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (``gelu_pytorch_tanh``); torch's ``F.gelu(x,
        approximate=...)``, computed in float32 and rounded once."""
        raise NotImplementedError

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        """LayerNorm over the last dim: (x - mean) / sqrt(var + eps) * weight + bias, var the biased variance
        (torch's ``F.layer_norm``, transformers' ``nn.LayerNorm``: StarCoder2, Falcon). Statistics and the
        affine in float32, the result rounded once to x's dtype. No fused residual (a model adds it first)."""
        raise NotImplementedError

    # ------------------------------------------------ quantized activations
    def quantize_per_token(self, x: torch.Tensor, fp8: bool) -> QuantizedInput:
        """x [..., K] quantized per token, as an 8-bit layer takes its input (devices/act_quant.py gives the
        rule; ``fp8``: e4m3 codes, else int8). A device may hand zero rows past x's (act_quant says how)."""
        raise NotImplementedError

    def rms_norm_quant(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor],
                       fp8: bool) -> Tuple[QuantizedInput, Optional[torch.Tensor]]:
        """rms_norm whose output goes to an 8-bit layer: (quantize_per_token(out), the residual sum as rms_norm
        returns it). The codes are those of rms_norm's rounded output; a device may fuse the two and never
        write that output (its sum of squares then in its own order: a code one step off in a rare row)."""
        out, res = self.rms_norm(x, weight, eps, residual)
        return self.quantize_per_token(out, fp8), res

    def silu_and_mul_quant(self, x: torch.Tensor, fp8: bool) -> QuantizedInput:
        """quantize_per_token(silu_and_mul(x)): the gated MLP's activation for an 8-bit down projection (a
        device may fuse the two)."""
        return self.quantize_per_token(self.silu_and_mul(x), fp8)

    # ------------------------------------------------------------- attention
    def fill_kv_cache(self, k: torch.Tensor, v: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor) -> None:
        """Write k/v [T, Hkv, D] into the cache at flat slots [T] (in place),
        quantized as ``cache.quant_policy`` says (devices/cache.py).
        Tokens whose slot is negative are skipped (padding)."""
        raise NotImplementedError

    def rotary_fill_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: KVCache, slot_mapping: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """apply_rotary, then fill_kv_cache with the rotated k and v; returns
        the rotated (q, k). What an attention layer does before it attends;
        a device may do it in one pass over the step's q, k and v."""
        q, k = self.apply_rotary(q, k, cos, sin)
        self.fill_kv_cache(k, v, cache, slot_mapping)
        return q, k

    def paged_prefill_attention(self, q: torch.Tensor, cache: KVCache, block_tables: torch.Tensor,
                                q_start_loc: torch.Tensor, q_seqlens: torch.Tensor, kv_seqlens: torch.Tensor,
                                scale: float, max_q_len: int, max_kv_len: int,
                                out: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                                logit_softcap: Optional[float] = None,
                                alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal attention of new tokens over the whole paged context.

        q [T, H, D] packs B sequences: sequence b owns rows
        ``q_start_loc[b] : q_start_loc[b] + q_seqlens[b]``. Its context has
        ``kv_seqlens[b]`` tokens already in the cache (including the new
        ones, written by :meth:`fill_kv_cache`); the new tokens are its last
        ``q_seqlens[b]``, so query row i sits at position
        ``kv_seqlens[b] - q_seqlens[b] + i`` and sees context positions up to
        and including that one. A quantized cache's K and V are dequantized
        (devices/cache.py) as they are read. GQA: query head h reads KV head
        ``h // (H // Hkv)``. block_tables [B, max_blocks] (int32, padded).
        Softmax in float32. Returns [T, H, D] in q's dtype; rows of q that no
        sequence owns (a step's decode rows, attended separately) are left
        unspecified. ``out`` ([T, H, D], optional): written in place of a new
        tensor (only the owned rows; the others keep what they hold) and
        returned. A sequence with ``q_seqlens[b] == 0`` owns no row (padding
        of a recorded step: ``max_q_len`` and the batch then only bound the
        work).

        ``sliding_window`` (optional, W >= 1): a query at position p sees only
        context positions j with p - W < j <= p (its last W tokens, itself
        included: transformers' Mistral / Qwen2 / Gemma2 mask). ``logit_softcap``
        (optional, c > 0): each score s = scale * q.k becomes c * tanh(s / c)
        before the mask and the softmax (Gemma2's attn_logit_softcapping).
        ``alibi_slopes`` (optional, [H] float32): ALiBi position biases, the
        score of query position p for context position j gaining
        ``alibi_slopes[h] * (j - p)`` (after the cap; Baichuan-13B, Falcon-RW).
        None: none of these (full causal attention, raw scores). With a window, a
        block table entry of a block wholly before every query's window may
        be -1 (freed by the engine): such blocks must not be read.
        """
        raise NotImplementedError

    def paged_decode_attention(self, q: torch.Tensor, cache: KVCache, block_tables: torch.Tensor,
                               kv_seqlens: torch.Tensor, scale: float,
                               max_kv_len: int, order: Optional[torch.Tensor] = None,
                               out: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                               logit_softcap: Optional[float] = None,
                               alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One new token per sequence: q [B, H, D] attends to all
        ``kv_seqlens[b]`` cached tokens. Same meaning as the prefill op with
        every q_seqlen equal to 1. ``order`` (optional, [B] integers) is a
        permutation of the rows, longest context first: a device may visit
        the rows in that order to balance its work; results do not depend
        on it. A row with ``kv_seqlens[b] == 0`` (padding) gets zeros.
        ``out`` ([B, H, D], optional): written in place of a new tensor and
        returned. ``sliding_window`` / ``logit_softcap`` / ``alibi_slopes`` as in
        the prefill op (the query sits at position ``kv_seqlens[b] - 1``)."""
        raise NotImplementedError

    # -------------------------------------------------------------- sampling
    def apply_repetition_penalty(self, logits: torch.Tensor, token_ids: torch.Tensor,
                                 penalty: torch.Tensor) -> torch.Tensor:
        """transformers' repetition penalty, in place and returned.

        logits [B, V] float32; token_ids [B, L] int64 padded with -1 (ids
        seen so far, repeats allowed); penalty [B]. For every id seen in row
        b: score / penalty if score > 0 else score * penalty.
        """
        raise NotImplementedError

    def apply_frequency_presence_penalty(self, logits: torch.Tensor, token_ids: torch.Tensor,
                                         frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
        """OpenAI's penalties, in place and returned.

        logits [B, V] float32; token_ids [B, L] int64 padded with -1 (the
        generated ids, repeats counted); frequency, presence [B]. For every id
        generated c > 0 times in row b: score - c * frequency - presence.
        """
        raise NotImplementedError

    def apply_temperature(self, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """logits [B, V] / temperature [B, 1]-broadcast (temperature > 0)."""
        raise NotImplementedError

    def top_k_top_p_min_p(self, logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                          min_p: Optional[torch.Tensor], max_top_k: Optional[int] = None) -> torch.Tensor:
        """Mask (to -inf) the tokens each filter removes; returns new logits.
        A filter given as None is off for every row (the caller knows that on
        the host, so the device need not be asked).

        top_k [B] int (0 = off): keep the k largest (ties at the k-th value
        are kept). top_p [B] (1 = off): keep the smallest set of the most
        likely tokens whose probability sum reaches top_p (the token that
        crosses it is kept; at least one token always stays). min_p [B]
        (0 = off): drop tokens with prob < min_p * max prob. Probabilities
        are the softmax of the input logits; filters apply in the order
        top-k, top-p, min-p, each on the survivors of the previous one.
        ``max_top_k``: at least every row's top_k, when the caller knows it on
        the host (the k-th values then come from a partial top-k of that
        size, not a sort of the vocabulary, and the device is not asked).
        """
        raise NotImplementedError

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Structured output: logits [B, V] float32 with every token its row's bitmask [B, ceil(V / 32)]
        int32 does not allow set to -inf; returns new logits. Bit j of word w allows token 32 w + j."""
        raise NotImplementedError

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy pick: the index of each row's largest logit [B, V] -> int64
        [B]; ties go to the lowest index (as torch.argmax)."""
        return logits.argmax(dim=-1)

    def sample(self, logits: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Draw one token per row from softmax(logits) [B, V]: int64 [B].

        Randomness is a counter-based hash of (seed, offset, token id), so a
        row's draw depends only on its own seed and offset (the number of
        tokens it generated before), never on the rest of the batch. The draw
        is the exponential race argmax(p / E) with E = -log(u), u uniform in
        (0, 1) from :func:`lmdeploy.devices.rng.uniform`.
        """
        raise NotImplementedError
