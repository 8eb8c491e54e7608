"""AWQ and GPTQ (4-bit weights, 16-bit activations) through torch_npu's weight-quantized matmul.

``npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset, antiquant_group_size=g)``
computes x @ ((weight + offset) * scale) with int4 weights [K, N] packed by
``npu_convert_weight_to_int4pack`` (values -8..7) and a scale and offset per group of g input rows and
output column (README.md: the pages). The formats' definition is W[o, i] = (q - z) * s with q in 0..15
(devices/quant_formats.py), so the weight is stored as q - 8 and the offset is 8 - z: (q - 8 + 8 - z) * s.

Groups must be runs of g consecutive input rows. GPTQ with ``desc_act`` assigns columns to groups in any
order; where each group has exactly g columns (what GPTQ's act-order writes), the input columns are
permuted once at load so that each group is a run, and the input is gathered in that order per call.
Other assignments keep the reference implementation (dequantize, then torch's matmul).

Not run on an NPU: checked against tests/npu_emulation (the packing order of the real op is its own; only
the matmul reads it).
"""
from __future__ import annotations

import torch

from ..layers import add_param
from ..quant_formats import AwqLinear, GptqLinear, _Int4GroupLinear, group_runs


class _NpuInt4Linear(_Int4GroupLinear):
    """After the reference's unpacking: weight int4-packed [K, N / 8], antiquant scale and offset [groups, N] in
    the model dtype, and (desc_act) the input columns' order."""

    def process_weights(self, layer):
        super().process_weights(layer)  # weight_q [out, in], zeros / scales [out, groups], group_of [in]
        groups = layer.scales.shape[1]
        order, size = group_runs(layer.group_of.data, groups)
        self.fused = size > 0  # groups of unequal sizes: the reference's dequantize-and-matmul
        if not self.fused:
            return
        q, zeros, scales = layer.weight_q.data, layer.zeros.data, layer.scales.data
        if order is not None:
            q = q[:, order]
        weight = (q.to(torch.int32) - 8).t().contiguous()  # [K, N], -8..7
        npu = self.ops._npu_ops
        dtype = scales.dtype
        for name in ('weight_q', 'zeros', 'scales', 'group_of'):
            delattr(layer, name)
            del layer.param_layout[name]
        add_param(layer, 'weight_int4', npu.npu_convert_weight_to_int4pack(weight), input_dim=0, keep_dtype=True)
        add_param(layer, 'antiquant_scale', scales.t().contiguous())
        add_param(layer, 'antiquant_offset', (8 - zeros.to(torch.int32)).t().contiguous().to(dtype))
        add_param(layer, 'column_order', order, output_dim=None, keep_dtype=True)
        self.group_size = 0 if groups == 1 else weight.shape[0] // groups

    def apply(self, layer, x, with_bias=True):
        if not self.fused:
            return super().apply(layer, x, with_bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.column_order is not None:
            x2 = x2.index_select(1, layer.column_order)
        y = self.ops._npu_ops.npu_weight_quant_batchmatmul(x2, layer.weight_int4, layer.antiquant_scale.to(x.dtype),
                                                           layer.antiquant_offset.to(x.dtype),
                                                           antiquant_group_size=self.group_size)
        if with_bias and layer.bias is not None:
            y = y + layer.bias.to(y.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])


class AscendAwqLinear(_NpuInt4Linear, AwqLinear):
    """AWQ (GEMM layout) through npu_weight_quant_batchmatmul."""


class AscendGptqLinear(_NpuInt4Linear, GptqLinear):
    """GPTQ (any group size, desc_act with equal groups) through npu_weight_quant_batchmatmul."""


W4A16_IMPLS = {('linear', AwqLinear.format): AscendAwqLinear, ('linear', GptqLinear.format): AscendGptqLinear}
