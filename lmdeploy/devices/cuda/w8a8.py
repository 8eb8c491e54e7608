"""SmoothQuant W8A8 on NVIDIA GPUs: the activation quantized per token by a Triton kernel (kernels/w8a8_quant.py:
in the norm's or the gated activation's own kernel where one of them comes before the layer, CudaOps'
rms_norm_quant / silu_and_mul_quant; else a kernel of its own), the 8-bit GEMM by torch (cuBLASLt / CUTLASS) or
Triton, with the scales.

* int8, up to 64 rows: ``torch._int_mm`` (int32 out), then a Triton epilogue (a_scale * weight_scale, cast,
  bias): one pass over the int32 result. cuda's _int_mm wants more than 16 rows, so a decode step's x_q is
  padded to 17 rows by the kernel that quantizes it (zero rows, no extra launch): the GEMM streams the weight
  either way, so 17 rows cost what 1 does.
* int8, more rows (sm80 on): one Triton GEMM with the scales, cast and bias fused (kernels/w8a8_gemm.py;
  cuBLASLt's int8 GEMM plus the separate epilogue was slower than bf16 there).
* int8 gate|up before an 8-bit down projection (sm80 on, any row count): one Triton GEMM writes silu(gate) * up
  and each row's max |value|, an elementwise kernel codes it (apply_silu_and_mul_quant; kernels/w8a8_gemm.py).
  On an H200 gate|up with the activation and its quantization took 35.5-37.5 us against 42-47 for the GEMM then
  silu_and_mul_quant at 1-64 rows, 70.1 against 71.5 at 256.
* fp8 (sm89+): ``torch._scaled_mm`` with row-wise scales (a_scale [M, 1], weight_scale [1, N]) and the bias in
  its epilogue, out in the activation dtype: one GEMM, for bf16 activations. For float16 ones (torch 2.11's
  row-wise kernel took them on an H100 but was off by up to 4 fp16 ulps against the exact result at 70 rows
  with a bias), float32 ones (torch takes no bias with a float32 out) and where torch refuses the row-wise
  scales, a unit-scaled GEMM to float32 and the int8 path's epilogue instead. Below sm89 (no e4m3 tensor
  cores) the reference runs.

Both GEMMs take the weight as the reference stores it: ``weight`` [out, in] row-major, passed as its
transposed view (a column-major [in, out]), the layout cuBLASLt's int8 / fp8 kernels want for their second
operand (``TN``); nothing is copied. Shapes the GEMMs refuse on cuda (in / out not multiples of 8 for int8,
16 for fp8) and float64 inputs run the reference. On cpu tensors (Triton's interpreter in the tests) the same
path runs on torch's cpu GEMMs.
"""
from __future__ import annotations

import torch

from ..layers import LinearImpl  # noqa: F401  (devices.layers first: it imports devices.w8a8 itself)
from ..act_quant import QuantizedInput
from ..w8a8 import W8A8Fp8Linear, W8A8Int8Linear

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FUSED_ROWS = 64  # int8: above this many rows, one Triton GEMM with the scales fused (kernels/w8a8_gemm.py)
INT_MM_MIN_ROWS = 17  # cuda's torch._int_mm wants more than 16 rows: int8 codes come padded to this (CudaOps)


def _kernels():
    from .kernels import w8a8_quant
    return w8a8_quant


class _CudaW8A8:
    """The shared part: process_weights decides once per layer whether the fast path applies; the input comes
    quantized by the op before the layer (the norm, the gated activation: CudaOps' rms_norm_quant and
    silu_and_mul_quant) or by the device's quantize_per_token here."""
    align = 8

    def _fast_ok(self, layer) -> bool:
        out_f, in_f = layer.weight.shape
        if not layer.weight.is_cuda:  # torch's cpu GEMMs (the interpreter's tests) take any shape
            return True
        return in_f % self.align == 0 and out_f % self.align == 0

    def process_weights(self, layer):
        super().process_weights(layer)
        layer.weight.data = layer.weight.data.contiguous()
        layer.weight_scale.data = layer.weight_scale.data.float().contiguous()
        layer.w8a8_fast = self._fast_ok(layer)
        w = layer.weight
        # int8's fused GEMM: Triton's int8 tl.dot compiles from sm80 on (below, _int_mm for every size)
        layer.w8a8_fused = not w.is_cuda or torch.cuda.get_device_capability(w.device) >= (8, 0)

    def input_quantization(self, layer):
        """Quantized inputs only where the fast path runs (elsewhere the reference quantizes its own)."""
        return super().input_quantization(layer) if getattr(layer, 'w8a8_fast', False) else None

    def _fast_input(self, layer, x):
        """x as a QuantizedInput where the fast path takes it, else None."""
        if not (getattr(layer, 'w8a8_fast', False) and x.dtype in _DTYPES):
            return None
        return self.quantized(x) if isinstance(x, QuantizedInput) else self.ops.quantize_per_token(x, self.fp8)

    def apply(self, layer, x, with_bias=True):
        qi = self._fast_input(layer, x)
        if qi is None:
            return super().apply(layer, x, with_bias)
        if qi.rows == 0:
            return qi.q.new_empty(*qi.lead, layer.weight.shape[0], dtype=qi.dtype)
        out = self._gemm(layer, qi, layer.bias if with_bias else None)
        return out.reshape(*qi.lead, out.shape[-1])


class CudaW8A8Int8Linear(_CudaW8A8, W8A8Int8Linear):
    """int8 x int8 -> int32 (torch._int_mm, then the scales; or, past FUSED_ROWS rows, one Triton GEMM with
    the scales fused): see the module's docstring."""

    def _gemm(self, layer, qi, bias):
        rows = qi.rows
        if rows > FUSED_ROWS and layer.w8a8_fused:
            from .kernels.w8a8_gemm import int8_gemm_scaled
            return int8_gemm_scaled(qi.q, layer.weight, qi.scale, layer.weight_scale, bias, qi.dtype, rows=rows,
                                    num_sms=getattr(self.ops, '_num_sms', 132))
        q = qi.q
        if q.shape[0] < INT_MM_MIN_ROWS:  # codes from elsewhere than CudaOps (which pads them)
            q = torch.cat((q, q.new_zeros(INT_MM_MIN_ROWS - q.shape[0], q.shape[1])))
        acc = torch._int_mm(q, layer.weight.t())
        return _kernels().scale_epilogue(acc, qi.scale, layer.weight_scale, bias, qi.dtype, rows=rows)

    def apply_silu_and_mul_quant(self, layer, x, fp8):
        """One Triton GEMM (sm80 on, any row count) writes silu(gate) * up and each row's max |value|
        (kernels/w8a8_gemm.gated_gemm_scaled), then an elementwise kernel codes it (for the down projection's
        int8 or e4m3): the codes of the composed path, apply then silu_and_mul_quant, bit for bit."""
        qi = self._fast_input(layer, x)
        if qi is None or not layer.w8a8_fused:
            return super().apply_silu_and_mul_quant(layer, x if qi is None else qi, fp8)
        from .kernels.w8a8_gemm import gated_gemm_scaled
        act, amax = gated_gemm_scaled(qi.q, layer.weight, qi.scale, layer.weight_scale, layer.bias, qi.dtype,
                                      rows=qi.rows, num_sms=getattr(self.ops, '_num_sms', 132))
        q, scale = _kernels().quantize_with_amax(act, amax, fp8, min_rows=0 if fp8 else INT_MM_MIN_ROWS)
        return QuantizedInput(q, scale, qi.rows, qi.dtype, qi.lead)


class CudaW8A8Fp8Linear(_CudaW8A8, W8A8Fp8Linear):
    """e4m3 x e4m3 with row-wise scales (torch._scaled_mm): see the module's docstring."""
    align = 16
    rowwise = True  # False: always the unit-scaled GEMM and the epilogue (the tests take that path too)

    def __init__(self, ops, config=None):
        super().__init__(ops, config)
        self._rowwise = {}  # (device, dtype) -> whether torch's row-wise scaled GEMM takes it (tried once)

    def _fast_ok(self, layer) -> bool:
        w = layer.weight
        if w.is_cuda and torch.cuda.get_device_capability(w.device) < (8, 9):
            return False
        return super()._fast_ok(layer)

    def _gemm(self, layer, qi, bias):
        q, a_scale, dtype = qi.q[:qi.rows], qi.scale[:qi.rows], qi.dtype
        w_t = layer.weight.t()
        key = (q.device, dtype)
        out = None
        if self.rowwise and dtype == torch.bfloat16 and self._rowwise.get(key, True):
            try:
                out = torch._scaled_mm(q, w_t, scale_a=a_scale, scale_b=layer.weight_scale.view(1, -1),
                                       bias=None if bias is None else bias.to(dtype), out_dtype=dtype)
                self._rowwise[key] = True
            except (RuntimeError, ValueError, NotImplementedError):  # refused before any launch
                self._rowwise[key] = False
        if out is None:
            one = self._one(q.device)
            acc = torch._scaled_mm(q, w_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
            out = _kernels().scale_epilogue(acc, a_scale, layer.weight_scale, bias, dtype)
        return out

    def _one(self, device):
        ones = self.__dict__.setdefault('_ones', {})
        if device not in ones:
            ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return ones[device]


# CudaOps.layer_impls' entries of this module
W8A8_IMPLS = {('linear', CudaW8A8Int8Linear.format): CudaW8A8Int8Linear,
              ('linear', CudaW8A8Fp8Linear.format): CudaW8A8Fp8Linear}
