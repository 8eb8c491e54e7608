"""An activation quantized per token, as 8-bit layers (SmoothQuant W8A8, devices/w8a8.py) take their input.

A layer whose producer knows it (the norm before q|k|v, the gated activation before the down projection) gets
its input already quantized: the producer's op writes the 8-bit codes and the per-token scales instead of a
16-bit tensor the layer would read again to quantize (DeviceOps.rms_norm_quant, silu_and_mul_quant). The codes
are the ones the layer would have made of the producer's 16-bit output, up to the order a fused norm sums a
row's squares in (on a GPU, a row in a few hundred may then come out a code apart: as close to the reference).

Quantization (dynamic, symmetric, one scale per row), computed in float32 (float64 for a float64 input):
a_scale[t] = max_i |x[t, i]| / QMAX (QMAX 127 for int8, 448 for e4m3), x_q = round(x / a_scale) clamped to +-127
(int8, ties to even) or x / a_scale cast to e4m3 (fp8, to nearest even, saturating at 448).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
INT8_MAX = 127.0
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


@dataclass
class QuantizedInput:
    """``q`` [>= rows, K] int8 / e4m3 and ``scale`` float32 [>= rows, 1] of ``rows`` tokens whose float values
    were ``dtype`` (the layer's output takes it). A device may hand more rows than ``rows`` (zeros: a GEMM that
    wants a minimum row count); only the first ``rows`` are the tokens'. ``lead`` is the input's shape without
    its last dim (the layer's output keeps it)."""
    q: torch.Tensor
    scale: torch.Tensor
    rows: int
    dtype: torch.dtype
    lead: Tuple[int, ...]

    @property
    def fp8(self) -> bool:
        return self.q.dtype == FP8_DTYPE

    @property
    def shape(self) -> Tuple[int, ...]:
        """The float input's shape."""
        return (*self.lead, self.q.shape[-1])

    def dequantized(self) -> torch.Tensor:
        """The float values the codes stand for, in ``dtype`` (what a check compares)."""
        x = self.q[:self.rows].to(self.scale.dtype) * self.scale[:self.rows]
        return x.to(self.dtype).reshape(self.shape)


def quantize_per_token(x: torch.Tensor, fp8: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x_q, a_scale [tokens, 1]) of a 2-D input: dynamic symmetric per-row quantization, computed in float32
    (float64 for a float64 input). x_q is int8 or float8_e4m3fn."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(ct)
    qmax = FP8_MAX if fp8 else INT8_MAX
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    # divided by a tensor, not the number: torch on a GPU turns division by a number into multiplication by
    # its reciprocal, which rounds differently (the scale must not depend on the device)
    scale = amax / torch.full_like(amax, qmax)
    y = xf / scale
    if fp8:
        return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    return y.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def steps_apart(got: torch.Tensor, want: torch.Tensor, fp8: bool) -> torch.Tensor:
    """|got - want| of two code tensors in steps of the codes' grid at ``want`` (float64, elementwise): an int8
    code, or e4m3's spacing at the value (2^(exponent - 3), 2^-9 among the subnormals)."""
    a, b = got.cpu().double(), want.cpu().double()
    step = 2.0**(torch.floor(torch.log2(b.abs().clamp(min=2.0**-6))) - 3) if fp8 else torch.ones_like(b)
    return (a - b).abs() / step


def quantize_input(x: torch.Tensor, fp8: bool) -> QuantizedInput:
    """x [..., K] as a :class:`QuantizedInput` (the reference's DeviceOps.quantize_per_token)."""
    q, scale = quantize_per_token(x.reshape(-1, x.shape[-1]), fp8)
    return QuantizedInput(q, scale, q.shape[0], x.dtype, tuple(x.shape[:-1]))
