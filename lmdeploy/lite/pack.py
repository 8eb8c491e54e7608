"""4-bit group quantization, AutoAWQ's GEMM layout and GPTQ's checkpoint format "gptq", as
:class:`lmdeploy.devices.quant_formats.AwqLinear` / ``GptqLinear`` read them, and the saved model directory.

A linear's weight W [out, in] becomes, per group of ``group`` input columns and per output row, a scale s
(float16) and an integer zero point z in 0..15: q = clamp(round(W / s) + z, 0, 15), W ~ (q - z) * s, with s =
(max - min) / 15 over the group (its min and max taken with 0, so 0 is exact) and z = round(-min / s).

Packed (the GEMM layout): ``qweight`` int32 [in, out / 8] (q transposed, 8 output columns an int32),
``qzeros`` int32 [in / group, out / 8] the same way, ``scales`` float16 [in / group, out]; nibble k (bits 4k to
4k + 3) of an int32 holds column ``AWQ_ORDER[k]`` of its block of 8. GPTQ's packing: :func:`gptq_tensors`.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Tuple, Union

import torch

import lmdeploy.devices.layers  # noqa: F401 (imports quant_formats, which needs it loaded first)
from lmdeploy.devices.quant_formats import AWQ_ORDER, PACK

MAX_Q = 15
SHARD_BYTES = 4 << 30
# files of a model directory that are the weights or their index (written anew), or the config (edited)
_WEIGHT_SUFFIXES = ('.safetensors', '.bin', '.pt', '.pth', '.gguf', '.safetensors.index.json', '.bin.index.json')


def group_params(g: torch.Tensor, sym: bool = False, min_zero: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scales (float16) and zero points (float, integers) for groups g [..., group] of weights, over the last dim.

    Asymmetric: s = (max - min) / 15 with 0 inside [min, max], z = round(-min / s) in ``min_zero``..15; where z
    would round below ``min_zero`` (1: GPTQ's checkpoint format stores z - 1 in 4 bits), the step becomes
    (max - min) / (15 - min_zero) with z = min_zero, so the range still fits. Symmetric (GPTQ's ``sym``): s =
    2 max|w| / 15, z = 8."""
    if sym:
        m = g.abs().amax(dim=-1)
        scales = (m * (2 / MAX_Q)).clamp(min=1e-5).half()
        return scales, torch.full_like(m, (MAX_Q + 1) // 2)
    lo = g.amin(dim=-1).clamp(max=0)
    hi = g.amax(dim=-1).clamp(min=0)
    scales = ((hi - lo) / MAX_Q).clamp(min=1e-5).half()  # as stored: q is computed with the stored scale
    zeros = (-lo / scales.float()).round().clamp(0, MAX_Q)
    if min_zero:
        low = zeros < min_zero
        if bool(low.any()):
            wide = ((hi - lo) / (MAX_Q - min_zero)).clamp(min=1e-5).half()
            scales = torch.where(low, wide, scales)
            zeros = zeros.clamp(min=min_zero)
    return scales, zeros


def quantize(w: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> q uint8 [out, in], zeros uint8 [out, in / group], scales float16 [out, in / group]."""
    out_f, in_f = w.shape
    if in_f % group:
        raise ValueError(f'input size {in_f} is not a multiple of the group size {group}')
    g = w.float().reshape(out_f, in_f // group, group)
    scales, zeros = group_params(g)
    s = scales.float()
    q = ((g / s.unsqueeze(2)).round() + zeros.unsqueeze(2)).clamp(0, MAX_Q)
    return q.reshape(out_f, in_f).to(torch.uint8), zeros.to(torch.uint8), scales


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q - z) * s in float32, [out, in]."""
    out_f, in_f = q.shape
    groups = zeros.shape[1]
    g = q.float().reshape(out_f, groups, in_f // groups)
    return ((g - zeros.float().unsqueeze(2)) * scales.float().unsqueeze(2)).reshape(out_f, in_f)


def fake_quantize(w: torch.Tensor, group: int) -> torch.Tensor:
    """W quantized and dequantized again, in W's dtype."""
    return dequantize(*quantize(w, group)).to(w.dtype)


def pack_int4(values: torch.Tensor, dim: int, order=None) -> torch.Tensor:
    """Values 0..15 -> int32, 8 consecutive values along ``dim`` (2-D: 0 or 1) an element, the inverse of
    :func:`lmdeploy.devices.quant_formats.unpack_int4`: nibble k (bits 4k..4k+3) holds position ``order[k]``
    of its block of 8 (``order`` None: position k)."""
    v = values.to(torch.int64).movedim(dim, -1)
    rows, cols = v.shape
    if cols % PACK:
        raise ValueError(f'{cols} values along dim {dim}: 8 are packed an int32')
    v = v.reshape(rows, cols // PACK, PACK)
    if order is not None:
        v = v[..., list(order)]  # [..., k]: nibble k
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=v.device)
    word = (v << shifts).sum(dim=-1)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)  # the same 32 bits, as a signed int32
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] of 0..15 -> int32 [rows, cols / 8] in AWQ's nibble order."""
    return pack_int4(values, 1, AWQ_ORDER)


def awq_tensors(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> Dict[str, torch.Tensor]:
    """One linear's checkpoint tensors (names after the module's prefix)."""
    return {'qweight': pack_awq(q.t().contiguous()), 'qzeros': pack_awq(zeros.t().contiguous()),
            'scales': scales.t().contiguous()}


def gptq_tensors(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor) -> Dict[str, torch.Tensor]:
    """One linear's tensors in GPTQ's checkpoint format "gptq" (what AutoGPTQ / GPTQModel write and
    :class:`lmdeploy.devices.quant_formats.GptqLinear` reads): ``qweight`` int32 [in / 8, out] (8 consecutive
    input rows an int32, row 8r + k in nibble k), ``qzeros`` int32 [groups, out / 8] holding z - 1 (output
    column 8c + k in nibble k), ``scales`` float16 [groups, out], ``g_idx`` int32 [in]. ``zeros`` must be at
    least 1 (:func:`group_params` with ``min_zero=1``)."""
    if zeros.numel() and int(zeros.min()) < 1:
        raise ValueError('GPTQ\'s "gptq" format stores zero points minus one: a zero point of 0 does not fit')
    return {'qweight': pack_int4(q.t(), 0), 'qzeros': pack_int4(zeros.t().to(torch.int64) - 1, 1),
            'scales': scales.t().contiguous(), 'g_idx': g_idx.to(torch.int32).clone()}


def quantization_config(group: int) -> dict:
    return {'quant_method': 'awq', 'version': 'gemm', 'bits': 4, 'group_size': group, 'zero_point': True}


def save_model(src: str, out: str, tensors: Dict[str, torch.Tensor], qconfig: Union[int, dict]):
    """Write ``tensors`` as safetensors into ``out`` (shards of at most 4 GiB with an index when bigger),
    ``src``'s config.json with ``quantization_config`` ``qconfig`` (an int: AWQ's with that group size), and every other file of ``src`` (tokenizer, chat
    template, generation config, remote code) copied."""
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if (name == 'config.json' or name.startswith('.') or name.endswith(_WEIGHT_SUFFIXES)
                or not os.path.isfile(path)):
            continue
        shutil.copy2(path, os.path.join(out, name))
    shards, size = [{}], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out, 'model.safetensors'), metadata={'format': 'pt'})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
            save_file(shard, os.path.join(out, fname), metadata={'format': 'pt'})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out, 'model.safetensors.index.json'), 'w') as f:
            json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
    with open(os.path.join(src, 'config.json')) as f:
        cfg = json.load(f)
    cfg['quantization_config'] = quantization_config(qconfig) if isinstance(qconfig, int) else qconfig
    with open(os.path.join(out, 'config.json'), 'w') as f:
        json.dump(cfg, f, indent=2)
