"""How a device runs a layer whose weights come in a given format.

A layer of the model (``engine/nn``) says what it is (a linear map with
these sizes) and leaves its parameters to a :class:`LinearImpl` that the
device picks by the checkpoint's weight format (``DeviceOps.layer_impl``).
The implementation does three things:

* ``create_weights``: the layer's parameters, with the names, shapes and
  dtypes the checkpoint stores them in (an int8 weight and its scales, ...);
  each says which of its dims are the layer's output rows and input columns,
  which is all the layer needs to load a tensor-parallel slice of it;
* ``process_weights``: once, after loading (repack, transpose, stack);
* ``apply``: the layer's output for an input.

The reference implements every format in plain torch over the device's
ops; a device gives faster ones of the formats it has kernels for, and the
conformance suite holds each to the reference. Adding a format is a class
here (or in a device package), an entry in :data:`FORMATS` and one in
``REFERENCE_IMPLS``: nothing in the engine changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch
from torch import nn

if TYPE_CHECKING:
    from .attention_meta import AttentionMeta
    from .interface import DeviceOps

DENSE = 'dense'


@dataclass(frozen=True)
class ParamLayout:
    """How a layer's parameter is laid out: its dim that is the layer's output rows, the one that is its
    input columns (None: it has none), and whether it keeps its dtype when the model takes the model dtype
    (an int8 weight).

    ``output_pack`` / ``input_pack``: how many output rows / input columns one element along that dim
    stands for (8 for int4 values packed in an int32, the group size for per-group scales); a
    tensor-parallel slice of it starts and ends on a multiple of that."""
    output_dim: Optional[int] = 0
    input_dim: Optional[int] = None
    keep_dtype: bool = False
    output_pack: int = 1
    input_pack: int = 1


def add_param(layer: nn.Module, name: str, t: Optional[torch.Tensor], **layout):
    """A frozen parameter on ``layer`` and its layout in ``layer.param_layout`` (kept apart from the
    parameter, which moving the model to its device replaces)."""
    if not hasattr(layer, 'param_layout'):
        layer.param_layout = {}
    setattr(layer, name, None if t is None else nn.Parameter(t, requires_grad=False))
    if t is not None:
        layer.param_layout[name] = ParamLayout(**layout)


def param_layout(layer: nn.Module, name: str) -> ParamLayout:
    return getattr(layer, 'param_layout', {}).get(name, ParamLayout())


class LinearImpl:
    """y = x W^T + b for one weight format. ``ops``: the device's kernels; ``config``: the checkpoint's
    ``quantization_config`` (group size, ...; {} for plain weights)."""
    kind = 'linear'
    format = DENSE
    # quantization_configs the conformance suite checks the format in (its linear is 48 in, 40 out)
    example_configs: Tuple[Dict[str, Any], ...] = ({}, )

    def __init__(self, ops: 'DeviceOps', config: Optional[Dict[str, Any]] = None):
        self.ops = ops
        self.config = dict(config or {})

    @classmethod
    def check_config(cls, config: Dict[str, Any]):
        """Raise ValueError, naming the field, for a ``quantization_config`` this format cannot load."""

    @classmethod
    def format_for(cls, config: Dict[str, Any]) -> str:
        """The weight format a (checked) ``quantization_config`` of this method loads as: one quant_method may
        name several (smooth_quant: int8 or fp8 by ``quant_dtype``)."""
        return cls.format

    def example_value(self, layer: nn.Module, name: str, g: torch.Generator) -> Optional[torch.Tensor]:
        """A random value for parameter ``name`` where random bits would not do (an index), for the
        conformance check; None: any value of its dtype."""
        return None

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool):
        add_param(layer, 'bias', torch.empty(out_features) if bias else None)

    def process_weights(self, layer: nn.Module):
        """Once, after every tensor of the layer is loaded."""

    def apply(self, layer: nn.Module, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        raise NotImplementedError

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a stacked gate|up projection's output (a device may fuse the two)."""
        return self.ops.silu_and_mul(self.apply(layer, x))

    def apply_silu_and_mul_quant(self, layer: nn.Module, x, fp8: bool):
        """silu(gate) * up of a stacked gate|up projection's output, quantized per token for an 8-bit layer after
        it (a devices/act_quant.QuantizedInput; a device may fuse all three)."""
        return self.ops.silu_and_mul_quant(self.apply(layer, x), fp8)

    def input_quantization(self, layer: nn.Module) -> Optional[str]:
        """'int8' or 'fp8' where ``apply`` also takes its input already quantized per token (a
        devices/act_quant.QuantizedInput, from the producer's fused op: the norm before the layer); None where
        it takes only a float tensor. Asked once per layer, after ``process_weights``."""
        return None


class DenseLinear(LinearImpl):
    """The checkpoint's weight as it is: [out, in] in the model dtype."""

    def create_weights(self, layer, in_features, out_features, bias):
        add_param(layer, 'weight', torch.empty(out_features, in_features), input_dim=1)
        super().create_weights(layer, in_features, out_features, bias)

    def apply(self, layer, x, with_bias=True):
        return self.ops.linear(x, layer.weight, layer.bias if with_bias else None)

    def apply_silu_and_mul(self, layer, x):
        return self.ops.linear_silu_and_mul(x, layer.weight, layer.bias)


class Int8ChannelLinear(LinearImpl):
    """Weight-only int8 with one scale per output row: W = weight * weight_scale[:, None] (int8 [out, in],
    float [out]); activations stay in the model dtype. (The worked example of adding a format: see
    docs/design.md.)"""
    format = 'int8_channel'

    def create_weights(self, layer, in_features, out_features, bias):
        add_param(layer, 'weight', torch.empty(out_features, in_features, dtype=torch.int8), input_dim=1,
                  keep_dtype=True)
        add_param(layer, 'weight_scale', torch.empty(out_features, dtype=torch.float32), keep_dtype=True)
        super().create_weights(layer, in_features, out_features, bias)

    def dequantized(self, layer, dtype: torch.dtype) -> torch.Tensor:
        return (layer.weight.float() * layer.weight_scale.float()[:, None]).to(dtype)

    def apply(self, layer, x, with_bias=True):
        return self.ops.linear(x, self.dequantized(layer, x.dtype), layer.bias if with_bias else None)


class EmbeddingImpl:
    """Token embedding rows for one weight format: ``weight`` [rows, dim]; apply looks ids up."""
    kind = 'embedding'
    format = DENSE

    def __init__(self, ops: 'DeviceOps', config: Optional[Dict[str, Any]] = None):
        self.ops = ops

    def create_weights(self, layer: nn.Module, num_rows: int, dim: int):
        add_param(layer, 'weight', torch.empty(num_rows, dim), input_dim=1)

    def process_weights(self, layer: nn.Module):
        """Once, after loading."""

    def apply(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.embedding(ids, layer.weight)


class NormImpl:
    """RMS norm's scale for one weight format: ``weight`` [dim]; apply normalises, with the residual add
    fused where one is given (the device's ``rms_norm``)."""
    kind = 'norm'
    format = DENSE

    def __init__(self, ops: 'DeviceOps', config: Optional[Dict[str, Any]] = None):
        self.ops = ops

    def create_weights(self, layer: nn.Module, dim: int):
        add_param(layer, 'weight', torch.ones(dim))

    def process_weights(self, layer: nn.Module):
        """Once, after loading."""

    def apply(self, layer: nn.Module, x: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
        return self.ops.rms_norm(x, layer.weight, eps, residual)

    def apply_quant(self, layer: nn.Module, x: torch.Tensor, eps: float, residual: Optional[torch.Tensor], fp8: bool):
        """``apply`` whose output goes to an 8-bit layer: (its QuantizedInput, the residual sum)."""
        return self.ops.rms_norm_quant(x, layer.weight, eps, residual, fp8)


class ExpertsImpl:
    """A mixture of experts' feed-forward networks for one weight format: every expert's stacked gate|up
    projection ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] (I: the intermediate rows this rank holds).
    ``apply`` runs each token through the experts its router picked and sums their outputs by the router's
    weights; the routing itself (softmax, top-k, renormalising) is the model's. This reference reads the
    experts' token counts on the host (one GEMM pair per expert used), so CUDA graphs cannot record it: a
    device with a grouped-GEMM kernel gives its own."""
    kind = 'experts'
    format = DENSE

    def __init__(self, ops: 'DeviceOps'):
        self.ops = ops

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, inter: int):
        add_param(layer, 'gate_up', torch.empty(num_experts, 2 * inter, hidden), output_dim=1, input_dim=2)
        add_param(layer, 'down', torch.empty(num_experts, hidden, inter), output_dim=1, input_dim=2)

    def process_weights(self, layer: nn.Module):
        """Once, after loading."""

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids / topk_weights [T, k] -> [T, H] (this rank's share where I is split)."""
        out = torch.zeros_like(x)
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=layer.gate_up.shape[0]).tolist()
        tokens = order // topk_ids.shape[1]
        weights = topk_weights.reshape(-1)[order].to(x.dtype)
        start = 0
        for e, n in enumerate(counts):  # each expert over the tokens that chose it, as one GEMM pair
            if n:
                rows = tokens[start:start + n]
                h = self.ops.silu_and_mul(self.ops.linear(x[rows], layer.gate_up[e]))
                out.index_add_(0, rows, self.ops.linear(h, layer.down[e]) * weights[start:start + n, None])
            start += n
        return out


class AttentionImpl:
    """One layer's paged attention: writes the step's K/V into the layer's cache (rotating q and k on the way
    where the model passes rotary tables) and attends over each sequence's context. No parameters; what the
    layer is (heads, ``scale``, its ``variant``: sliding window, soft cap, ALiBi slopes) is the model's, what
    the step is the ``meta`` (devices/attention_meta.py). A device may give its own (a fused kernel, its own
    metadata prepared once a step)."""
    kind = 'attention'
    format = DENSE

    def __init__(self, ops: 'DeviceOps', config: Optional[Dict[str, Any]] = None):
        self.ops = ops

    def create_weights(self, layer: nn.Module):
        """None: attention has no parameters of its own."""

    def process_weights(self, layer: nn.Module):
        """Once, after loading."""

    def apply(self, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], meta: 'AttentionMeta', cache,
              variant: Dict[str, Any]) -> torch.Tensor:
        """q [T, H, D], k / v [T, Hkv, D] before RoPE (``cos`` None: nothing rotates) -> [T, H, D]."""
        ops = self.ops
        if cos is None:
            ops.fill_kv_cache(k, v, cache, meta.slot_mapping)
        else:
            q, k = ops.rotary_fill_kv(q, k, v, cos, sin, cache, meta.slot_mapping)
        if meta.is_decode:
            return ops.paged_decode_attention(q, cache, meta.block_tables, meta.kv_seqlens, layer.scale,
                                              meta.max_kv_len, meta.decode_order, **variant)
        # the leading one-token rows as a decode batch, then the prompt rows (q_start_loc holds their rows in q)
        # over them: in a recorded step the decode batch is padded past the real one-token rows, and its padding
        # rows (no context: zeros) may be prompt rows, which the prefill then writes
        nd = meta.num_decode
        out = torch.empty_like(q)
        if nd:
            ops.paged_decode_attention(q[:nd], cache, meta.block_tables[:nd], meta.kv_seqlens[:nd], layer.scale,
                                       meta.max_kv_len, meta.decode_order, out=out[:nd], **variant)
        ops.paged_prefill_attention(q, cache, meta.block_tables[nd:], meta.q_start_loc[nd:], meta.q_seqlens[nd:],
                                    meta.kv_seqlens[nd:], layer.scale, meta.max_q_len, meta.max_kv_len, out=out,
                                    **variant)
        return out


class RotaryImpl:
    """Rotary tables of a step: cos / sin [T, head_dim] (float32) from the tokens' positions and the inverse
    frequencies the model's rope type gives (one set [D/2], or one per token [T, D/2]: dynamic NTK, LongRoPE).
    ``rotary_dim`` < head_dim: the first rotary_dim / 2 pairs rotate, the rest pass through (cos 1, sin 0), the
    layout of engine/nn/rotary.partial_rotary_order. ``attention_factor`` scales both (LongRoPE's). No
    parameters; a device may give its own (tables cached per position, as a fused kernel wants them)."""
    kind = 'rotary'
    format = DENSE

    def __init__(self, ops: 'DeviceOps', config: Optional[Dict[str, Any]] = None):
        self.ops = ops

    def create_weights(self, layer: nn.Module):
        """None: the frequencies are the model's (they depend on the config, not on a checkpoint tensor)."""

    def process_weights(self, layer: nn.Module):
        """Once, after loading."""

    def apply(self, layer: nn.Module, positions: torch.Tensor, inv_freq: torch.Tensor, head_dim: int,
              attention_factor: float = 1.0):
        freqs = positions.float()[:, None] * (inv_freq if inv_freq.dim() == 2 else inv_freq[None, :])
        if 2 * freqs.shape[-1] != head_dim:  # partial: pass-through dims after the rotating ones, in each half
            pad = head_dim // 2 - freqs.shape[-1]
            cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
            cos = torch.cat((cos, torch.ones_like(cos[:, :1]).expand(-1, pad)), dim=-1)
            sin = torch.cat((sin, torch.zeros_like(sin[:, :1]).expand(-1, pad)), dim=-1)
            return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        if attention_factor != 1.0:  # LongRoPE's: scales q.k by its square
            return emb.cos() * attention_factor, emb.sin() * attention_factor
        return emb.cos(), emb.sin()


from .quant_formats import AwqLinear, GptqLinear  # noqa: E402 (they subclass LinearImpl above)
from .w8a8 import W8A8Fp8Linear, W8A8Int8Linear  # noqa: E402

# the checkpoint's quantization_config["quant_method"] -> weight format
FORMATS: Dict[str, str] = {'int8_per_channel': Int8ChannelLinear.format, 'awq': AwqLinear.format,
                           'gptq': GptqLinear.format,
                           # SmoothQuant W8A8: int8 or fp8 by quantization_config.quant_dtype (format_for)
                           'smooth_quant': W8A8Int8Linear.format}

# (layer kind, weight format) -> the reference's implementation. Kinds: 'linear' (fused q|k|v and gate|up
# included), 'lm_head' (a linear map to the vocabulary, kept apart so a device can give its own: a
# vocabulary-sharded or fused-sampling head), 'embedding', 'norm', 'experts' (a mixture of experts' FFNs),
# 'attention' (paged, with the cache write), 'rotary' (the step's cos / sin tables)
REFERENCE_IMPLS: Dict[Tuple[str, str], Any] = {
    ('linear', DENSE): DenseLinear,
    ('linear', Int8ChannelLinear.format): Int8ChannelLinear,
    ('linear', AwqLinear.format): AwqLinear,
    ('linear', GptqLinear.format): GptqLinear,
    ('linear', W8A8Int8Linear.format): W8A8Int8Linear,
    ('linear', W8A8Fp8Linear.format): W8A8Fp8Linear,
    ('lm_head', DENSE): DenseLinear,
    ('embedding', DENSE): EmbeddingImpl,
    ('norm', DENSE): NormImpl,
    ('experts', DENSE): ExpertsImpl,
    ('attention', DENSE): AttentionImpl,
    ('rotary', DENSE): RotaryImpl,
}


def weight_format(quantization_config: Optional[Dict[str, Any]]) -> str:
    """The weight format a checkpoint's ``quantization_config`` (config.json) names; 'dense' without one."""
    if not quantization_config:
        return DENSE
    method = quantization_config.get('quant_method') if isinstance(quantization_config, dict) else None
    if method not in FORMATS:
        raise ValueError(f'config.json: quantization_config.quant_method {method!r} is not supported; supported: '
                         f'{sorted(FORMATS)} (or no quantization_config: plain weights)')
    cls = REFERENCE_IMPLS[('linear', FORMATS[method])]
    cls.check_config(quantization_config)
    return cls.format_for(quantization_config)


def check_model_format(model_format: Optional[str], quantization_config: Optional[Dict[str, Any]],
                       where: str = 'config.json') -> None:
    """LMDeploy's ``--model-format``: the user's word for what the checkpoint holds. config.json's
    ``quantization_config`` decides how the weights load; a format named here must be the one it names,
    else the checkpoint is refused before anything loads (a float model served as 'awq', say, would
    otherwise run unquantized without a word). None and 'hf': no claim."""
    if model_format in (None, 'hf'):
        return
    method = quantization_config.get('quant_method') if isinstance(quantization_config, dict) else None
    if method == model_format:
        return
    says = (f'says quant_method {method!r}' if quantization_config else
            'has no quantization_config (plain weights)')
    raise ValueError(f'--model-format {model_format} (PytorchEngineConfig.model_format), but {where} {says}: the '
                     f'weights load as config.json describes them; drop the flag, or point at a checkpoint '
                     f'quantized as {model_format} (lmdeploy lite writes them)')
