"""An emulation of the torch_npu functions lmdeploy's ascend device calls, in plain torch on CPU tensors.

NOT torch_npu: written from each op's documentation (argument names, layouts, host-side length lists,
block tables; lmdeploy/devices/ascend/README.md lists the pages) so the ascend device can be run and
tested where there is no NPU. Importable as ``torch_npu`` only inside the tests (tests/npu_emulation
on sys.path, see ``activate.py``). Importing it adds ``torch.npu`` (tests/npu_emulation/torch_npu/npu.py),
as the real package does; the emulated device is the CPU, so its tensors are CPU tensors.

Each op checks the arguments it is documented to require, so a call the real op would refuse fails here
too, and computes its result from the documented formula. Ops inside an emulated graph capture are
recorded as one entry each (npu.py), so a replay runs them again with the host arguments
``NPUGraph.update`` gave.
"""
from __future__ import annotations

import functools

import torch

from . import _state
from . import npu as _npu

torch.npu = _npu
__version__ = '0.0+emulated'
EMULATED = True


def _op(graph_updatable=()):
    """An emulated op: recorded as one entry (not as its aten ops) inside a graph capture."""

    def wrap(fn):
        fn.graph_updatable = tuple(graph_updatable)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            _state.depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                _state.depth -= 1
            if _state.recording is not None and not _state.depth:
                _state.recording.entries.append(('op', run, args, kwargs, (out, {})))
            return out

        run.graph_updatable = fn.graph_updatable
        return run

    return wrap


def _need(cond, msg):
    if not cond:
        raise RuntimeError(msg)


# ------------------------------------------------------------------ norms, rotary, activation
@_op()
def npu_rms_norm(x, gamma, epsilon=1e-6):
    """(y, rstd): rstd = 1 / sqrt(mean(x^2) + epsilon) over gamma's trailing dims, y = x * rstd * gamma,
    computed in float32, y in x's dtype."""
    _need(x.shape[-gamma.dim():] == gamma.shape, 'gamma must match the trailing dims of x')
    dims = tuple(range(-gamma.dim(), 0))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


@_op()
def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """(y, rstd, x): x = x1 + x2, then npu_rms_norm's y and rstd of x."""
    _need(x1.shape == x2.shape and x1.dtype == x2.dtype, 'x1 and x2 must have one shape and dtype')
    x = x1 + x2
    y, rstd = npu_rms_norm.__wrapped__(x, gamma, epsilon)
    return y, rstd, x


@_op()
def npu_rotary_mul(input, r1, r2, rotary_mode='half'):
    """4-D input; r1 (cos) / r2 (sin) broadcast to it, in its dtype. 'half': x * r1 + cat(-x2, x1) * r2."""
    _need(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, 'npu_rotary_mul takes 4-D tensors')
    _need(r1.dtype == input.dtype and r2.dtype == input.dtype, 'r1 / r2 must have the input dtype')
    _need(rotary_mode == 'half', 'only rotary_mode="half" is emulated')
    x1, x2 = input.chunk(2, dim=-1)
    return input * r1 + torch.cat((-x2, x1), dim=-1) * r2


@_op()
def npu_swiglu(input, dim=-1):
    """Halves a, b of input along dim: silu(a) * b."""
    _need(input.is_contiguous() and input.shape[dim] % 2 == 0, 'npu_swiglu takes a contiguous, even-split input')
    a, b = input.chunk(2, dim=dim)
    return (torch.nn.functional.silu(a.float()) * b.float()).to(input.dtype)


@_op()
def npu_gelu(input, approximate='none'):
    """GELU(x) = x * Phi(x) ('none': Phi through erf; 'tanh': erf replaced by the tanh approximation), the
    output of input's shape and dtype (float16, bfloat16, float32 on the A2)."""
    _need(approximate in ('none', 'tanh'), 'approximate must be "none" or "tanh"')
    _need(input.dtype in (torch.float16, torch.bfloat16, torch.float32), 'npu_gelu takes float16 / bfloat16 / float32')
    return torch.nn.functional.gelu(input.float(), approximate=approximate).to(input.dtype)


# ------------------------------------------------------------------ weight-quantized matmul (W4A16)
@_op()
def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    """int32 [k, n] of values in [-8, 7] (contiguous, n a multiple of 8) -> int32 [k, n / 8], eight 4-bit
    values an int32. The NPU interleaves them in an order of its own ("交叠排放"); only
    npu_weight_quant_batchmatmul reads the result, so here value j of a group of eight is bits 4j..4j+3
    (two's complement), and the matmul below unpacks the same way."""
    _need(weight.dtype == torch.int32 and weight.dim() == 2 and weight.is_contiguous(),
          'npu_convert_weight_to_int4pack takes a contiguous 2-D int32 tensor')
    _need(weight.shape[-1] % 8 == 0, 'the last dimension must be a multiple of 8')
    _need(bool(((weight >= -8) & (weight <= 7)).all()), 'values must be in the int4 range [-8, 7]')
    nib = (weight & 0xF).view(weight.shape[0], -1, 8).to(torch.int64)
    packed = (nib << (4 * torch.arange(8, dtype=torch.int64))).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack_int4(packed):
    nib = (packed.to(torch.int64).unsqueeze(-1) >> (4 * torch.arange(8, dtype=torch.int64))) & 0xF
    return torch.where(nib >= 8, nib - 16, nib).reshape(packed.shape[0], -1)


@_op()
def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
    """y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias, x [M, K] float16 / bfloat16 (float32
    accepted here so that emulated runs compare exactly with the cpu device), weight int8 [K, N] or int32
    [K, N / 8] (int4 through npu_convert_weight_to_int4pack); scale and offset in x's dtype, [1, N] / [N]
    per channel or [ceil(K / antiquant_group_size), N] per group; the output in x's dtype. Output
    quantization (quant_scale) is not emulated."""
    _need(x.dim() == 2 and weight.dim() == 2, 'x [M, K] and weight [K, N] are 2-D')
    _need(x.dtype in (torch.float16, torch.bfloat16, torch.float32), 'x must be float16 / bfloat16')
    _need(quant_scale is None and quant_offset is None, 'output quantization is not emulated')
    if weight.dtype == torch.int32:
        w = _unpack_int4(weight)
    else:
        _need(weight.dtype == torch.int8, 'weight must be int8, or int32 carrying int4')
        w = weight.to(torch.int64)
    k, n = w.shape
    _need(x.shape[1] == k, f'x has K = {x.shape[1]}, weight {k}')
    groups = -(-k // antiquant_group_size) if antiquant_group_size > 0 else 1
    want = (groups, n)
    for name, t in (('antiquant_scale', antiquant_scale), ('antiquant_offset', antiquant_offset)):
        if t is None:
            continue
        _need(t.dtype == x.dtype, f'{name} must have x\'s dtype')
        _need(tuple(t.reshape(-1, n).shape) == want, f'{name} must be {list(want)} here, got {list(t.shape)}')
    rows = torch.arange(k) // antiquant_group_size if antiquant_group_size > 0 else torch.zeros(k, dtype=torch.long)
    wf = w.to(torch.float32)
    if antiquant_offset is not None:
        wf = wf + antiquant_offset.reshape(-1, n).float()[rows]
    wf = (wf * antiquant_scale.reshape(-1, n).float()[rows]).to(x.dtype)
    y = x @ wf
    return y if bias is None else y + bias.to(x.dtype)


# ------------------------------------------------------------------ KV cache
_SCATTER_DTYPES = (torch.float32, torch.float16, torch.bool, torch.bfloat16, torch.int64, torch.int8)  # A2, 7.0.0


@_op()
def npu_scatter_nd_update_(input, indices, updates):
    """In place: input[indices[i]] = updates[i], indices [..., K] (at least 2-D) indexing input's first K
    dims, updates indices.shape[:-1] + input.shape[K:]. Returns input."""
    _need(input.dtype in _SCATTER_DTYPES, f'input dtype {input.dtype} is not supported')
    _need(indices.dtype in (torch.int32, torch.int64), 'indices must be int32 or int64')
    _need(indices.dim() >= 2 and indices.shape[-1] <= input.dim(), 'indices must be at least 2-D, [..., K <= dims]')
    k = indices.shape[-1]
    _need(updates.shape == indices.shape[:-1] + input.shape[k:], 'updates shape mismatch')
    _need(updates.dtype == input.dtype, 'updates must have the input dtype')
    idx = indices.long().reshape(-1, k)
    _need(bool(((idx >= 0) & (idx < torch.tensor(input.shape[:k]))).all()), 'index out of range')
    input[tuple(idx.t())] = updates.reshape(-1, *input.shape[k:])
    return input


# ------------------------------------------------------------------ attention
_MASK_SIZE = 2048
_checked_mask = [None]  # the last mask found upper-triangular (the device makes one and keeps it)


_PER_TOKEN_HEAD_PAGED = 5  # key / value antiquant mode: per token and head, scale / offset in page blocks


@_op(graph_updatable=('actual_seq_lengths', 'actual_seq_lengths_kv'))
def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, block_table=None, key_antiquant_scale=None,
                                    key_antiquant_offset=None, value_antiquant_scale=None,
                                    value_antiquant_offset=None, num_heads=1, scale=1.0, pre_tokens=2147483647,
                                    next_tokens=2147483647, input_layout='BSH', num_key_value_heads=0, sparse_mode=0,
                                    inner_precise=0, block_size=0, antiquant_mode=0, softmax_lse_flag=False,
                                    key_antiquant_mode=0, value_antiquant_mode=0, **others):
    """(attention_out, softmax_lse) for the cases the ascend device uses, the KV cache paged (block_table,
    block_size; key / value [block_num, block_size, Hkv * D]) in both:

    * layout 'TND' (query [T, N, D]): ``actual_seq_lengths`` the queries' cumulative lengths (host ints, the
      last one T), ``actual_seq_lengths_kv`` each sequence's context length, sparse_mode 0 (no mask) or 3
      (rightDownCausal: the 2048 x 2048 upper-triangular bool atten_mask aligned to each sequence's bottom
      right); key / value in the query's dtype (no antiquant).
    * layout 'BSND' with Q_S = 1 (query [B, 1, N, D], the incremental branch): each row sees its
      ``actual_seq_lengths_kv`` context (``actual_seq_lengths`` and sparse_mode do not apply); key / value
      in the query's dtype, or int8 with ``key_antiquant_mode == value_antiquant_mode == 5`` (per token and
      head, page-managed): ``*_antiquant_scale`` / ``*_antiquant_offset`` float32 [block_num, Hkv,
      block_size], a token's values read as (x + offset) * scale (offset None: 0, symmetric).

    Softmax in float32; GQA (query head h reads KV head h // (num_heads // num_key_value_heads))."""
    unused = {k: v for k, v in others.items() if v is not None}
    _need(not unused and pse_shift is None, f'arguments not emulated: {sorted(unused) or ["pse_shift"]}')
    _need(input_layout in ('TND', 'BSND'), f'only input_layout TND or BSND is emulated, got {input_layout}')
    _need(antiquant_mode == 0, 'the combined antiquant (antiquant_mode) is not emulated')
    _need(block_table is not None, 'only the paged KV cache (block_table) is emulated')
    _need(block_table.dtype == torch.int32 and block_table.dim() == 2, 'block_table must be int32 [B, max_blocks]')
    _need(query.is_contiguous(), 'query must be contiguous')
    if input_layout == 'TND':
        _need(query.dim() == 3 and query.shape[1] == num_heads, 'TND query must be [T, num_heads, D]')
    else:
        _need(query.dim() == 4 and query.shape[2] == num_heads, 'BSND query must be [B, S, num_heads, D]')
        _need(query.shape[1] == 1, 'BSND is emulated for Q_S = 1 (the incremental branch) only')
        _need(sparse_mode == 0 and atten_mask is None, 'BSND with Q_S = 1 is emulated without a mask')
    lens_args = [('actual_seq_lengths_kv', actual_seq_lengths_kv)]
    if input_layout == 'TND':
        lens_args.insert(0, ('actual_seq_lengths', actual_seq_lengths))
    for name, lens in lens_args:
        _need(isinstance(lens, (list, tuple)) and all(isinstance(x, int) for x in lens),
              f'{name} must be a list of host ints')
    if input_layout == 'TND':
        batch = len(actual_seq_lengths)
        _need(actual_seq_lengths[-1] == query.shape[0], 'TND: the last cumulative query length must be T')
        ends = list(actual_seq_lengths)
    else:
        batch = query.shape[0]
        ends = list(range(1, batch + 1))
    _need(len(actual_seq_lengths_kv) == batch and block_table.shape[0] == batch, 'batch sizes differ')
    hkv = num_key_value_heads or num_heads
    _need(num_heads % hkv == 0, 'num_heads must be a multiple of num_key_value_heads')
    d = query.shape[-1]
    _need(key.dim() == 3 and key.shape == value.shape and key.shape[1] == block_size and key.shape[2] == hkv * d,
          'paged key / value must be [block_num, block_size, num_key_value_heads * D]')
    antiquant = key_antiquant_scale is not None or value_antiquant_scale is not None
    if antiquant:
        _need(key_antiquant_mode == value_antiquant_mode == _PER_TOKEN_HEAD_PAGED,
              'only key / value antiquant mode 5 (per token and head, page-managed) is emulated')
        _need(input_layout == 'BSND', 'antiquant with page attention is documented for Q_S = 1 only')
        _need(key.dtype == torch.int8 and value.dtype == torch.int8, 'antiquant mode 5 takes int8 key / value')
        _need(key_antiquant_scale is not None and value_antiquant_scale is not None,
              'key / value antiquant scales are both given or both None')
        _need((key_antiquant_offset is None) == (value_antiquant_offset is None),
              'key / value antiquant offsets are both given or both None')
        want = (key.shape[0], hkv, block_size)
        for t in (key_antiquant_scale, key_antiquant_offset, value_antiquant_scale, value_antiquant_offset):
            _need(t is None or (tuple(t.shape) == want and t.dtype == torch.float32),
                  f'mode 5 scale / offset must be float32 {want} (block_num, N, block_size)')
    else:
        _need(key_antiquant_mode == value_antiquant_mode == 0, 'antiquant modes without antiquant scales')
        _need(key.dtype == query.dtype, 'key / value must have the query dtype')
    if sparse_mode == 3:
        _need(atten_mask is not None and atten_mask.dtype == torch.bool
              and tuple(atten_mask.shape) == (_MASK_SIZE, _MASK_SIZE), 'sparse_mode 3 needs a 2048x2048 bool mask')
        if atten_mask is not _checked_mask[0]:
            _need(bool(torch.equal(atten_mask, torch.ones_like(atten_mask).triu(1))),
                  'sparse_mode 3 needs the upper-triangular mask')
            _checked_mask[0] = atten_mask
    else:
        _need(sparse_mode == 0 and atten_mask is None, 'only sparse_mode 0 (no mask) or 3 is emulated')

    def context(data, scale_, offset_, blocks, kv_len):
        """[L, Hkv, D] float32 of one sequence's context, dequantized where antiquant is on."""
        x = data[blocks].reshape(len(blocks), block_size, hkv, d).float()
        if antiquant:
            off = 0.0 if offset_ is None else offset_[blocks].transpose(1, 2)[..., None]
            x = (x + off) * scale_[blocks].transpose(1, 2)[..., None]
        return x.reshape(-1, hkv, d)[:kv_len]

    group = num_heads // hkv
    q_all = query.reshape(-1, num_heads, d)
    out = torch.empty_like(q_all)
    start = 0
    for b in range(batch):
        end, kv_len = ends[b], actual_seq_lengths_kv[b]
        q_len = end - start
        _need(0 <= q_len and 1 <= kv_len and q_len <= kv_len, f'sequence {b}: bad lengths ({q_len}, {kv_len})')
        n_blocks = -(-kv_len // block_size)
        _need(n_blocks <= block_table.shape[1], f'sequence {b}: context beyond its block table')
        blocks = block_table[b, :n_blocks].long()
        k = context(key, key_antiquant_scale, key_antiquant_offset, blocks, kv_len)  # [L, Hkv, D]
        v = context(value, value_antiquant_scale, value_antiquant_offset, blocks, kv_len)
        q = q_all[start:end].float()  # [Q, H, D]
        s = torch.einsum('qhd,lhd->hql', q, k.repeat_interleave(group, dim=1)) * scale
        if sparse_mode == 3:
            rows = torch.arange(q_len)[:, None] + (kv_len - q_len)
            s = s.masked_fill(torch.arange(kv_len)[None, :] > rows, float('-inf'))
        p = torch.softmax(s, dim=-1)
        out[start:end] = torch.einsum('hql,lhd->qhd', p, v.repeat_interleave(group, dim=1)).to(query.dtype)
        start = end
    lse = torch.empty(0, dtype=torch.float32) if not softmax_lse_flag else None
    _need(lse is not None, 'softmax_lse_flag is not emulated')
    return out.reshape(query.shape), lse


def npu_fusion_attention(*args, **kwargs):
    """Not emulated (lmdeploy does not call it); transformers imports the name when it finds torch_npu."""
    raise NotImplementedError('npu_fusion_attention is not part of the torch_npu emulation')
