"""The experts layer kind (devices/layers.ExpertsImpl, engine/nn/moe.MoEExperts): per-expert checkpoint tensors
load into the device's stacked parameters, and the block computes, for each token, the router-weighted sum of
its experts' SwiGLU outputs exactly as a direct per-token loop over the same tensors does; two tensor-parallel
ranks' shares sum to the whole. (No model uses it yet: the MoE families come with their issue.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmdeploy.devices import get_device
from lmdeploy.engine.nn.build import building
from lmdeploy.engine.nn.loading import CheckpointTensor
from lmdeploy.engine.nn.moe import MoEExperts
from lmdeploy.engine.nn.parallel import set_tensor_parallel

E, H, INTER, TOP = 6, 32, 40, 2


def _checkpoint(g):
    return {(e, part): torch.randn(*(shape), generator=g, dtype=torch.float64) / 6
            for e in range(E) for part, shape in (('gate', (INTER, H)), ('up', (INTER, H)), ('down', (H, INTER)))}


def _build(tensors, rank=0, size=1):
    set_tensor_parallel(rank, size)
    try:
        with building(get_device('cpu')):
            block = MoEExperts(E, H, INTER).double()
        for shard, t in tensors.items():
            block.load_param(f'experts.{shard[0]}.{shard[1]}', shard, CheckpointTensor(t))
        block.process_weights()
        return block
    finally:
        set_tensor_parallel(0, 1)


def _route(g, tokens):
    """Mixtral's routing: softmax over the experts, top-k, renormalised."""
    probs = torch.randn(tokens, E, generator=g, dtype=torch.float64).softmax(-1)
    weights, ids = probs.topk(TOP, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _direct(tensors, x, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = F.silu(tensors[e, 'gate'] @ x[t]) * (tensors[e, 'up'] @ x[t])
            out[t] += w * (tensors[e, 'down'] @ h)
    return out


def test_experts_block_is_the_routed_sum_of_swiglu_experts():
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    tensors = _checkpoint(g)
    x = torch.randn(11, H, generator=g, dtype=torch.float64)
    weights, ids = _route(g, 11)
    ids[0] = torch.tensor([3, 1])  # an expert chosen by some tokens first and others second
    ids[1] = torch.tensor([1, 3])
    got = _build(tensors)(x, weights, ids)
    torch.testing.assert_close(got, _direct(tensors, x, weights, ids), rtol=1e-10, atol=1e-10)


def test_two_ranks_hold_intermediate_slices_that_sum_to_the_whole():
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    tensors = _checkpoint(g)
    x = torch.randn(7, H, generator=g, dtype=torch.float64)
    weights, ids = _route(g, 7)
    parts = [_build(tensors, rank, 2) for rank in range(2)]
    assert [p.gate_up.shape for p in parts] == [(E, INTER, H)] * 2  # each rank: half of gate's and up's rows
    total = sum(p.impl.apply(p, x, weights, ids) for p in parts)  # what the all-reduce sums
    torch.testing.assert_close(total, _direct(tensors, x, weights, ids), rtol=1e-10, atol=1e-10)


def test_a_wrong_expert_tensor_is_refused_by_name():
    g = torch.Generator().manual_seed(0)
    tensors = _checkpoint(g)
    tensors[2, 'up'] = tensors[2, 'up'][:-1]
    with pytest.raises(ValueError, match=r'experts\.2\.up: expert 2 up has 39 rows, expected 40'):
        _build(tensors)
