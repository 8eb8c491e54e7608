"""AWQ and GPTQ (4-bit weights, 16-bit activations) on the cuda device: the reference's loading, then one
repack into the W4A16 kernel's layout (kernels/w4a16.py), so ``apply`` reads a quarter of a 16-bit weight's
bytes and never builds the full matrix.

GPTQ with ``desc_act`` (g_idx in any order): the layer's input columns are permuted at load so that the
groups are contiguous (a stable sort by g_idx), and ``apply`` gathers x's columns by the same permutation
(one index_select of the activations, cheap next to the weight read). Where the sorted groups are all
``K / G`` columns long (a real desc_act checkpoint's are) the kernel reads one row of scales per tile;
otherwise it looks each column's group up (g_idx passed to the kernel). A layer whose input size is not a
multiple of 8 keeps the reference's tensors and apply."""
from __future__ import annotations

import torch

from ..layers import add_param
from ..quant_formats import AwqLinear, GptqLinear, group_runs


class _W4A16:
    """Mixed in before the reference's class: its process_weights unpacks, this one repacks."""

    def process_weights(self, layer):
        super().process_weights(layer)
        q, zeros, scales, group_of = layer.weight_q.data, layer.zeros.data, layer.scales.data, layer.group_of.data
        n, k = q.shape
        if k % 8:
            return  # the kernel's layout packs 8 inputs an int32: the reference's apply
        from .kernels.w4a16 import pack_int4, reserve_locks
        reserve_locks(q.device)  # (the GEMV's counters: made before any CUDA graph records a call)
        perm, size = group_runs(group_of, scales.shape[1])  # desc_act: groups made contiguous
        if perm is not None:
            q, group_of = q[:, perm], group_of[perm]
        uniform = size > 0
        for name in ('weight_q', 'zeros', 'scales', 'group_of'):  # (the bias stays)
            delattr(layer, name)
            del layer.param_layout[name]
        add_param(layer, 'w4_qweight', pack_int4(q), output_dim=1, keep_dtype=True)
        add_param(layer, 'w4_scales', scales.t().contiguous(), output_dim=1, keep_dtype=True)
        add_param(layer, 'w4_zeros', zeros.t().to(scales.dtype).contiguous(), output_dim=1, keep_dtype=True)
        add_param(layer, 'w4_perm', perm, output_dim=None, keep_dtype=True)
        add_param(layer, 'w4_gidx', None if uniform else group_of.to(torch.int32).contiguous(), output_dim=None,
                  keep_dtype=True)
        layer.w4_group = size if uniform else 1

    def apply(self, layer, x, with_bias=True):
        if getattr(layer, 'w4_qweight', None) is None:
            return super().apply(layer, x, with_bias)
        from .kernels.w4a16 import w4a16_linear
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if layer.w4_perm is not None:
            x = x.index_select(1, layer.w4_perm)
        out = w4a16_linear(x, layer.w4_qweight, layer.w4_scales, layer.w4_zeros, layer.w4_group, layer.w4_gidx,
                           layer.bias if with_bias else None, getattr(self.ops, '_num_sms', 132))
        return out.reshape(*lead, out.shape[-1])


class CudaAwqLinear(_W4A16, AwqLinear):
    """AWQ (GEMM layout) through the W4A16 kernel."""


class CudaGptqLinear(_W4A16, GptqLinear):
    """GPTQ (desc_act or not, any group size) through the W4A16 kernel."""


# CudaOps.layer_impls' entries for these formats
W4A16_IMPLS = {('linear', AwqLinear.format): CudaAwqLinear, ('linear', GptqLinear.format): CudaGptqLinear}
