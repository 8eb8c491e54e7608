"""A paged KV cache filled by the reference device, for tests of other devices' attention kernels."""
from __future__ import annotations

import dataclasses

import torch

from lmdeploy.devices import get_device


def reference_filled_cache(lengths, hkv, d, block_size, dtype, policy, device, spare_blocks=3, head_major=False):
    """A cache of the standard layout (``policy`` 0, 8 or 4) that the cpu reference filled with random K
    (rows of different ranges) and V for sequences of ``lengths`` tokens over shuffled blocks, plus
    ``spare_blocks`` unused zero ones. Returns (the cpu cache, a copy on ``device``, block tables [B, W]):
    a kernel given the copy must attend over exactly what the reference's attention reads. ``head_major``:
    the copy stores its blocks head-major (devices/cache.py), the same values in another order."""
    ref_ops = get_device('cpu')
    nblocks = [-(-n // block_size) for n in lengths]
    total = sum(nblocks) + spare_blocks
    spec = ref_ops.kv_cache_spec(hkv, d, block_size, dtype, policy)
    ref = spec.allocate(total, 'cpu')
    for t in ref.tensors().values():
        t.zero_()
    perm = torch.randperm(total).tolist()
    tables = torch.zeros((len(lengths), max(nblocks)), dtype=torch.int32)
    for b, n in enumerate(lengths):
        blocks = [perm.pop() for _ in range(nblocks[b])]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor([blocks[j // block_size] * block_size + j % block_size for j in range(n)])
        k = (torch.randn(n, hkv, d) * torch.rand(n, hkv, 1) * 4).to(dtype)
        ref_ops.fill_kv_cache(k, torch.randn(n, hkv, d).to(dtype), ref, slots)
    moved = dataclasses.replace(spec, head_major=head_major).allocate(total, device)
    for name, t in moved.tensors().items():
        t.copy_(ref.tensors()[name])
    return ref, moved, tables
