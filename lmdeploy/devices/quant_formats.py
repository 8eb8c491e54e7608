"""4-bit weight-only formats other tools write: AWQ (its GEMM layout) and GPTQ (W4A16).

Both store a linear's weight as 4-bit integers q, eight to an int32, with a scale s and an integer zero
point z per group of ``group_size`` input columns and per output row: W[o, i] = (q[o, i] - z[o, g(i)]) *
s[o, g(i)]. They differ in how they pack:

* AWQ GEMM (AutoAWQ's ``WQLinear_GEMM``): ``qweight`` int32 [in, out/8], each int32 holding 8 output
  columns of one input row, nibble k (bits 4k..4k+3) holding column ``AWQ_ORDER[k]`` of its block of 8;
  ``qzeros`` int32 [in/group, out/8] packed the same way; ``scales`` [in/group, out]; g(i) = i // group.
* GPTQ (AutoGPTQ / optimum / transformers, checkpoint format "gptq"): ``qweight`` int32 [in/8, out], each
  int32 holding 8 consecutive input rows of one output column (nibble k: row 8r+k); ``qzeros`` int32
  [groups, out/8], nibble k: output column 8c+k, storing z - 1 (the format's historical offset, which
  readers add back); ``scales`` [groups, out]; ``g_idx`` int32 [in]: the group of each input row (i //
  group, or any assignment with ``desc_act``, where the columns were quantized in another order).
  ``group_size`` -1: one group (per output channel).

The reference implementations here unpack once after loading into one uint8 per value (half of a 16-bit
weight's memory; the packed form is a quarter) and dequantize per call before the device's ``linear``.
They are the formats' definition that a device's fast kernel is checked against, not a fast path.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from .layers import LinearImpl, add_param

# AWQ GEMM: the output column (within a block of 8) that nibble k of an int32 holds
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACK = 8  # 4-bit values per int32


def unpack_int4(packed: torch.Tensor, dim: int, order=None) -> torch.Tensor:
    """int32 ``packed`` -> uint8 values 0..15, 8 per element along ``dim`` (that dim grows 8 times): the
    value k of an element is its bits 4k..4k+3, and lands at position ``order[k]`` of its block of 8
    (``order``: None for 0..7 in turn)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]: value k of each element
    if order is not None:
        where = [0] * PACK
        for k, pos in enumerate(order):
            where[pos] = k
        nib = nib[..., where]  # position j holds value where[j]
    nib = nib.movedim(-1, dim + 1)  # the 8 values of an element follow it along ``dim``
    shape = list(packed.shape)
    shape[dim] *= PACK
    return nib.reshape(shape).to(torch.uint8)


def group_runs(group_of: torch.Tensor, groups: int) -> Tuple[Optional[torch.Tensor], int]:
    """For a device that wants each group's input columns side by side (GPTQ act-order assigns groups in any
    order): (the stable permutation of input columns that makes every group a run, or None where they already
    are; the run length where every group is ``in / groups`` columns long and the runs are in group order once
    permuted, else 0, a per-column group lookup being needed)."""
    n_in = group_of.shape[0]
    perm = None
    if n_in > 1 and bool((group_of[1:] < group_of[:-1]).any()):
        perm = torch.sort(group_of, stable=True).indices
        group_of = group_of[perm]
    size = n_in // groups if groups and n_in % groups == 0 else 0
    if size and not torch.equal(group_of, torch.arange(n_in, device=group_of.device) // size):
        size = 0
    return perm, size


def _field(config: Dict[str, Any], *names, default=None):
    for n in names:
        if n in config and config[n] is not None:
            return config[n]
    return default


def _refuse(method: str, field: str, value, want: str):
    raise ValueError(f'config.json: quantization_config.{field} = {value!r} is not supported for quant_method '
                     f'{method!r}; {want}')


class _Int4GroupLinear(LinearImpl):
    """What AWQ and GPTQ share: 4-bit values with a scale and zero point per group of input columns, unpacked
    after loading into ``weight_q`` uint8 [out, in], ``zeros`` uint8 [out, groups], ``scales`` [out, groups]
    and ``group_of`` int64 [in]; applied by dequantizing to the input's dtype."""
    method = ''

    @classmethod
    def _bits_and_group(cls, config):
        bits = _field(config, 'bits', 'w_bit', default=4)
        if bits != 4:
            _refuse(cls.method, 'bits', bits, 'only 4-bit weights load')
        group = _field(config, 'group_size', 'q_group_size', default=128)
        if not isinstance(group, int) or isinstance(group, bool) or not (group > 0 or group == -1):
            _refuse(cls.method, 'group_size', group, 'a positive group size, or -1 for one group per row')
        modules = config.get('modules_to_not_convert')
        if modules:
            _refuse(cls.method, 'modules_to_not_convert', modules, 'every linear layer of the decoder quantized '
                    'the same way loads (layers kept in float are not supported yet)')
        return group

    def _group(self, in_features: int) -> int:
        group = _field(self.config, 'group_size', 'q_group_size', default=128)
        return in_features if group == -1 else group

    @staticmethod
    def _fits(what: str, n: int, multiple: int, why: str):
        if n % multiple:
            raise ValueError(f'{what} is {n}, not a multiple of {multiple} ({why}); under tensor parallelism '
                             'this is the part one rank holds')

    def _unpacked(self, layer: nn.Module, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                  group_of: torch.Tensor):
        """Replace the checkpoint's tensors by the unpacked ones (q [out, in], zeros / scales [out, groups])."""
        for name in list(layer.param_layout):
            if name != 'bias':
                delattr(layer, name)
                del layer.param_layout[name]
        add_param(layer, 'weight_q', q.contiguous(), input_dim=1, keep_dtype=True)
        add_param(layer, 'zeros', zeros.contiguous(), keep_dtype=True)
        add_param(layer, 'scales', scales.contiguous())
        add_param(layer, 'group_of', group_of.to(torch.int64), output_dim=None, keep_dtype=True)

    def dequantized(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] = (q - z[group]) * s[group], computed in float32 (float64 for a float64 input)."""
        ct = torch.float64 if dtype == torch.float64 else torch.float32
        g = layer.group_of
        z = layer.zeros.to(ct)[:, g]
        s = layer.scales.to(ct)[:, g]
        return ((layer.weight_q.to(ct) - z) * s).to(dtype)

    def apply(self, layer, x, with_bias=True):
        return self.ops.linear(x, self.dequantized(layer, x.dtype), layer.bias if with_bias else None)


class AwqLinear(_Int4GroupLinear):
    """AWQ, GEMM layout (``quant_method: awq``, ``version: gemm``, 4 bits, zero points): see the module's
    docstring."""
    format = 'awq'
    method = 'awq'
    example_configs = ({'quant_method': 'awq', 'bits': 4, 'group_size': 16, 'zero_point': True,
                        'version': 'gemm'}, )

    @classmethod
    def check_config(cls, config):
        group = cls._bits_and_group(config)
        if group == -1:
            _refuse(cls.method, 'group_size', group, 'AWQ checkpoints have a positive group size')
        version = str(_field(config, 'version', default='gemm')).lower()
        if version != 'gemm':
            _refuse(cls.method, 'version', version, "only the 'gemm' layout (AutoAWQ's default) loads; gemv, "
                    'gemv_fast, exllama and marlin pack differently')
        if _field(config, 'zero_point', default=True) is not True:
            _refuse(cls.method, 'zero_point', config.get('zero_point'), 'only asymmetric weights with zero '
                    'points (zero_point: true) load')

    def create_weights(self, layer, in_features, out_features, bias):
        g = self._group(in_features)
        self._fits('awq: a linear layer\'s output size', out_features, PACK, '8 columns per int32')
        self._fits('awq: a linear layer\'s input size', in_features, g, f'group_size {g}')
        add_param(layer, 'qweight', torch.empty(in_features, out_features // PACK, dtype=torch.int32),
                  output_dim=1, output_pack=PACK, input_dim=0, keep_dtype=True)
        add_param(layer, 'qzeros', torch.empty(in_features // g, out_features // PACK, dtype=torch.int32),
                  output_dim=1, output_pack=PACK, input_dim=0, input_pack=g, keep_dtype=True)
        add_param(layer, 'scales', torch.empty(in_features // g, out_features), output_dim=1, input_dim=0,
                  input_pack=g)
        super().create_weights(layer, in_features, out_features, bias)

    def process_weights(self, layer):
        n_in = layer.qweight.shape[0]
        q = unpack_int4(layer.qweight.data, 1, AWQ_ORDER).t()
        zeros = unpack_int4(layer.qzeros.data, 1, AWQ_ORDER).t()
        scales = layer.scales.data.t()
        group_of = torch.arange(n_in, device=q.device) // self._group(n_in)
        self._unpacked(layer, q, zeros, scales, group_of)


class GptqLinear(_Int4GroupLinear):
    """GPTQ, 4 bits, checkpoint format "gptq" (``desc_act`` with ``g_idx``, ``sym`` or not, ``group_size`` -1
    for per channel): see the module's docstring."""
    format = 'gptq'
    method = 'gptq'
    example_configs = tuple({'quant_method': 'gptq', 'bits': 4, 'group_size': g, 'desc_act': d, 'sym': s}
                            for g, d, s in ((16, False, True), (16, True, False), (-1, False, False),
                                            (-1, True, True)))

    @classmethod
    def check_config(cls, config):
        cls._bits_and_group(config)
        fmt = str(_field(config, 'checkpoint_format', default='gptq')).lower()
        if fmt != 'gptq':
            _refuse(cls.method, 'checkpoint_format', fmt, "only 'gptq' (zero points stored minus one) loads")
        if _field(config, 'is_marlin_format', default=False):
            _refuse(cls.method, 'is_marlin_format', True, 'Marlin-repacked checkpoints do not load')
        for name in ('desc_act', 'sym'):
            if not isinstance(_field(config, name, default=False), bool):
                _refuse(cls.method, name, config.get(name), 'true or false')

    @property
    def desc_act(self) -> bool:
        return bool(_field(self.config, 'desc_act', default=False))

    def create_weights(self, layer, in_features, out_features, bias):
        per_channel = _field(self.config, 'group_size', default=128) == -1
        g = self._group(in_features)
        self._fits('gptq: a linear layer\'s output size', out_features, PACK, '8 zero points per int32')
        self._fits('gptq: a linear layer\'s input size', in_features, PACK, '8 rows per int32')
        if not per_channel:
            self._fits('gptq: a linear layer\'s input size', in_features, g, f'group_size {g}')
        groups = in_features // g
        # groups follow input columns in order, except with desc_act (g_idx picks any group for a column) or
        # per channel (one group): there every rank holds them all
        by_cols = {} if (per_channel or self.desc_act) else dict(input_dim=0, input_pack=g)
        add_param(layer, 'qweight', torch.empty(in_features // PACK, out_features, dtype=torch.int32),
                  output_dim=1, input_dim=0, input_pack=PACK, keep_dtype=True)
        add_param(layer, 'qzeros', torch.empty(groups, out_features // PACK, dtype=torch.int32), output_dim=1,
                  output_pack=PACK, keep_dtype=True, **by_cols)
        add_param(layer, 'scales', torch.empty(groups, out_features), output_dim=1, **by_cols)
        add_param(layer, 'g_idx', torch.empty(in_features, dtype=torch.int32), output_dim=None, input_dim=0,
                  keep_dtype=True)
        super().create_weights(layer, in_features, out_features, bias)

    def example_value(self, layer, name, g):
        if name != 'g_idx':
            return None
        n_in, groups = layer.g_idx.shape[0], layer.scales.shape[0]
        if not self.desc_act:
            return torch.arange(n_in, dtype=torch.int32) * groups // n_in
        return torch.randint(0, groups, (n_in, ), generator=g, dtype=torch.int32)

    def process_weights(self, layer):
        q = unpack_int4(layer.qweight.data, 0).t()
        zeros = (unpack_int4(layer.qzeros.data, 1) + 1).t()  # stored minus one ("gptq" format)
        scales = layer.scales.data.t()
        n_in = q.shape[1]
        if self.desc_act:
            group_of = layer.g_idx.data.long()
            if len(group_of) and (int(group_of.min()) < 0 or int(group_of.max()) >= scales.shape[1]):
                raise ValueError(f'gptq: g_idx names groups {int(group_of.min())}..{int(group_of.max())}, the '
                                 f'layer has {scales.shape[1]}')
        else:  # g_idx is i // group then (global under tensor parallelism): this rank's, counted from 0
            group_of = torch.arange(n_in, device=q.device) // (n_in // scales.shape[1])
        self._unpacked(layer, q, zeros, scales, group_of)
