"""W8A8 weight formats (SmoothQuant, as ``lmdeploy lite smooth_quant`` writes them): 8-bit weights *and*
8-bit activations.

config.json: ``quantization_config = {"quant_method": "smooth_quant", "quant_dtype": "int8" | "fp8", ...}``
(``quant_dtype`` also accepts ``"float8_e4m3fn"`` / ``"fp8_e4m3"`` for fp8; other fields written by ``lite``:
``weight_scheme: "per_channel_symmetric"``, ``activation_scheme: "per_token_dynamic"``, ``smooth_alpha``; only
``quant_dtype`` and ``activation_scheme`` are read). Each decoder linear holds

* ``weight`` [out, in]: int8 (values -127..127) or float8_e4m3fn, one symmetric scale per output row,
* ``weight_scale`` float32 [out]: W[o, i] = weight[o, i] * weight_scale[o] (bias, if any, stays float),

and at apply time the input is quantized per token (row), dynamically and symmetrically:
a_scale[t] = max_i |x[t, i]| / QMAX (QMAX 127 for int8, 448 for e4m3), x_q = round(x / a_scale) clamped to
+-127 (int8) or x / a_scale cast to e4m3 (fp8, round to nearest even, saturating at 448). The output is then
what an integer (or fp8) GEMM computes: acc[t, o] = sum_i x_q[t, i] * weight[o, i] accumulated exactly, times
a_scale[t] * weight_scale[o]. This reference accumulates int8 in int32 (``torch._int_mm``, an integer GEMM,
where torch has it for the shape and device: the cpu does; else float64) and e4m3 in float64, both exact: an
int8 product is at most 127^2 (sums stay far below 2^31 and 2^53), and an e4m3 product has 8 significant bits
between 2^-18 and 2^18, so any sum of them fits 53 bits. The smoothing factors (SmoothQuant) are already folded into the preceding
norms' weights and the weights' columns by ``lite``: nothing of them is left to apply here.

Under tensor parallelism a rank quantizes the part of a token's input it holds with its own scale (a row-
parallel layer's input columns): finer than one rank's, and what a fused kernel on that rank would do.

The input may come already quantized (devices/act_quant.py: the norm or the gated activation before the layer
wrote the codes and scales in one op): the same codes as quantizing the producer's float output here.

These are the formats' definition that a fast kernel is held to: the cuda device's (devices/cuda/w8a8.py:
a Triton per-token quantize, ``torch._int_mm`` / ``torch._scaled_mm``) quantizes the input to the same values;
other devices run this reference.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .act_quant import (FP8_DTYPE, FP8_MAX, INT8_MAX, QuantizedInput, quantize_input,  # noqa: F401 (re-exported)
                        quantize_per_token)
from .layers import LinearImpl, add_param

QUANT_DTYPES = {'int8': 'int8', 'fp8': 'fp8', 'float8_e4m3fn': 'fp8', 'fp8_e4m3': 'fp8', 'float8': 'fp8'}


def _quant_dtype(config) -> str:
    value = config.get('quant_dtype', 'int8')
    key = QUANT_DTYPES.get(str(value).lower())
    if key is None:
        raise ValueError(f'config.json: quantization_config.quant_dtype = {value!r} is not supported for '
                         f"quant_method 'smooth_quant'; 'int8' or 'fp8' (e4m3)")
    return key


def quantize_per_channel(w: torch.Tensor, fp8: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weight_q [out, in] int8 / e4m3, weight_scale float32 [out]) of a float weight, one symmetric scale a
    row (what ``lite smooth_quant`` writes)."""
    wf = w.double()
    qmax = FP8_MAX if fp8 else INT8_MAX
    scale = (wf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / qmax).float().double()
    y = wf / scale
    q = y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE) if fp8 else y.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.squeeze(1).float()


def int8_gemm(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_i q[t, i] * w[o, i] exactly, of int8 q [T, in] and w [out, in]: int32 through torch's integer GEMM
    where it takes the shape on this device (cuda's wants more than 16 rows), else float64."""
    if hasattr(torch, '_int_mm'):
        try:
            return torch._int_mm(q.contiguous(), w.t())
        except (RuntimeError, NotImplementedError):
            pass
    return q.double() @ w.double().t()


class W8A8Linear(LinearImpl):
    """SmoothQuant W8A8 (``quant_method: smooth_quant``), int8 or fp8 e4m3 by ``quant_dtype``: see the
    module's docstring. Subclasses fix the dtype; :meth:`format_for` picks one from the config."""
    method = 'smooth_quant'
    fp8 = False

    @classmethod
    def check_config(cls, config):
        _quant_dtype(config)
        scheme = config.get('activation_scheme', 'per_token_dynamic')
        if scheme not in ('per_token_dynamic', 'dynamic'):
            raise ValueError(f'config.json: quantization_config.activation_scheme = {scheme!r} is not supported '
                             "for quant_method 'smooth_quant'; only 'per_token_dynamic' (static activation "
                             'scales are not)')
        modules = config.get('modules_to_not_convert')
        if modules:
            raise ValueError(f'config.json: quantization_config.modules_to_not_convert = {modules!r} is not '
                             "supported for quant_method 'smooth_quant' (layers kept in float do not load yet)")

    @classmethod
    def format_for(cls, config) -> str:
        return W8A8Fp8Linear.format if _quant_dtype(config) == 'fp8' else W8A8Int8Linear.format

    def create_weights(self, layer, in_features, out_features, bias):
        add_param(layer, 'weight', torch.empty(out_features, in_features,
                                               dtype=FP8_DTYPE if self.fp8 else torch.int8),
                  input_dim=1, keep_dtype=True)
        add_param(layer, 'weight_scale', torch.empty(out_features, dtype=torch.float32), keep_dtype=True)
        super().create_weights(layer, in_features, out_features, bias)

    def dequantized(self, layer, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] = weight * weight_scale (what the float check multiplies the fake-quantized input by)."""
        return (layer.weight.double() * layer.weight_scale.double()[:, None]).to(dtype)

    def input_quantization(self, layer) -> Optional[str]:
        return 'fp8' if self.fp8 else 'int8'

    def fake_quantized_input(self, x: Union[torch.Tensor, QuantizedInput]) -> torch.Tensor:
        """The input as the layer sees it: quantized per token and dequantized again (in x's dtype)."""
        return self.quantized(x).dequantized()

    def quantized(self, x: Union[torch.Tensor, QuantizedInput]) -> QuantizedInput:
        """x as this layer's 8-bit input: quantized here, or already by its producer (the same codes)."""
        if isinstance(x, QuantizedInput):
            if x.fp8 != self.fp8:
                raise TypeError(f'a {"fp8" if x.fp8 else "int8"} input for a {self.format} layer')
            return x
        return quantize_input(x, self.fp8)

    def apply(self, layer, x, with_bias=True):
        qi = self.quantized(x)
        q, a_scale = qi.q[:qi.rows], qi.scale[:qi.rows]
        # exact: see the module's docstring
        acc = q.double() @ layer.weight.double().t() if self.fp8 else int8_gemm(q, layer.weight)
        out = (acc * a_scale.double() * layer.weight_scale.double()).to(qi.dtype)
        if with_bias and layer.bias is not None:
            out = out + layer.bias.to(qi.dtype)
        return out.reshape(*qi.lead, out.shape[-1])


class W8A8Int8Linear(W8A8Linear):
    """SmoothQuant W8A8 int8: int8 weights per output channel, int8 activations per token."""
    format = 'w8a8_int8'
    example_configs = ({'quant_method': 'smooth_quant', 'quant_dtype': 'int8'}, )


class W8A8Fp8Linear(W8A8Linear):
    """SmoothQuant W8A8 fp8 (e4m3): e4m3 weights per output channel, e4m3 activations per token."""
    format = 'w8a8_fp8'
    fp8 = True
    example_configs = ({'quant_method': 'smooth_quant', 'quant_dtype': 'fp8'}, )
