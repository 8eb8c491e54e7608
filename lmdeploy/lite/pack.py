"""4-bit group quantization and AutoAWQ's GEMM layout, as :class:`lmdeploy.devices.quant_formats.AwqLinear`
reads it, and the saved model directory.

A linear's weight W [out, in] becomes, per group of ``group`` input columns and per output row, a scale s
(float16) and an integer zero point z in 0..15: q = clamp(round(W / s) + z, 0, 15), W ~ (q - z) * s, with s =
(max - min) / 15 over the group (its min and max taken with 0, so 0 is exact) and z = round(-min / s).

Packed (the GEMM layout): ``qweight`` int32 [in, out / 8] (q transposed, 8 output columns an int32),
``qzeros`` int32 [in / group, out / 8] the same way, ``scales`` float16 [in / group, out]; nibble k (bits 4k to
4k + 3) of an int32 holds column ``AWQ_ORDER[k]`` of its block of 8.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Tuple

import torch

import lmdeploy.devices.layers  # noqa: F401 (imports quant_formats, which needs it loaded first)
from lmdeploy.devices.quant_formats import AWQ_ORDER, PACK

MAX_Q = 15
SHARD_BYTES = 4 << 30
# files of a model directory that are the weights or their index (written anew), or the config (edited)
_WEIGHT_SUFFIXES = ('.safetensors', '.bin', '.pt', '.pth', '.gguf', '.safetensors.index.json', '.bin.index.json')


def quantize(w: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> q uint8 [out, in], zeros uint8 [out, in / group], scales float16 [out, in / group]."""
    out_f, in_f = w.shape
    if in_f % group:
        raise ValueError(f'input size {in_f} is not a multiple of the group size {group}')
    g = w.float().reshape(out_f, in_f // group, group)
    lo = g.amin(dim=2).clamp(max=0)
    hi = g.amax(dim=2).clamp(min=0)
    scales = ((hi - lo) / MAX_Q).clamp(min=1e-5).half()  # as stored: q is computed with the stored scale
    s = scales.float()
    zeros = (-lo / s).round().clamp(0, MAX_Q)
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


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] of 0..15 -> int32 [rows, cols / 8] in AWQ's nibble order."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f'{cols} columns: AWQ packs 8 output columns an int32')
    v = values.to(torch.int64).reshape(rows, cols // PACK, PACK)[..., list(AWQ_ORDER)]  # [..., k]: nibble k
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    word = (v << shifts).sum(dim=-1)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)  # the same 32 bits, as a signed int32
    return word.to(torch.int32)


def awq_tensors(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> Dict[str, torch.Tensor]:
    """One linear's checkpoint tensors (names after the module's prefix)."""
    return {'qweight': pack_awq(q.t().contiguous()), 'qzeros': pack_awq(zeros.t().contiguous()),
            'scales': scales.t().contiguous()}


def quantization_config(group: int) -> dict:
    return {'quant_method': 'awq', 'version': 'gemm', 'bits': 4, 'group_size': group, 'zero_point': True}


def save_model(src: str, out: str, tensors: Dict[str, torch.Tensor], group: int):
    """Write ``tensors`` as safetensors into ``out`` (shards of at most 4 GiB with an index when bigger),
    ``src``'s config.json with ``quantization_config``, and every other file of ``src`` (tokenizer, chat
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
    cfg['quantization_config'] = quantization_config(group)
    with open(os.path.join(out, 'config.json'), 'w') as f:
        json.dump(cfg, f, indent=2)
