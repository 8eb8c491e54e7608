"""AWQ (GEMM layout) and GPTQ 4-bit checkpoints (devices/quant_formats.py): a tiny model quantized here into
each layout, with the quantization_config other tools write, decodes token for token as transformers decodes
the same weights dequantized; the unpacking inverts packers written here from the formats' descriptions;
configs outside what loads are refused by field name; two ranks (gloo) give one rank's tokens."""
from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from engine_utils import generate_all, greedy
from helpers import hf_greedy

from lmdeploy.devices.layers import weight_format

LINEAR_NAMES = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
# projections that read the same input share a desc_act column order (they are stacked in one layer)
SAME_INPUT = {'q_proj': 'qkv', 'k_proj': 'qkv', 'v_proj': 'qkv', 'gate_proj': 'gate_up', 'up_proj': 'gate_up'}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# ------------------------------------------------------------------------------------------- packers
def _int32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.uint32).view(np.int32).copy())


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] of 0..15 -> int32 [rows, cols / 8]: AutoAWQ's WQLinear_GEMM.from_linear (awq/modules/linear/
    gemm.py) puts column 8c + order[k] of a block in bits 4k..4k+3 of element c, order = 0, 2, 4, 6, 1, 3, 5, 7."""
    v = values.numpy().astype(np.uint64)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint64)
    for c in range(out.shape[1]):
        for k in range(8):
            out[:, c] |= v[:, 8 * c + AWQ_ORDER[k]] << np.uint64(4 * k)
    return _int32(out)


def pack_gptq_rows(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] of 0..15 -> int32 [rows / 8, cols]: AutoGPTQ's QuantLinear.pack (auto_gptq/nn_modules/qlinear/
    qlinear_cuda_old.py) puts row 8r + k in bits 4k..4k+3 of row r."""
    v = values.numpy().astype(np.uint64)
    out = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.uint64)
    for r in range(out.shape[0]):
        for k in range(8):
            out[r] |= v[8 * r + k] << np.uint64(4 * k)
    return _int32(out)


def pack_gptq_cols(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] of 0..15 -> int32 [rows, cols / 8], column 8c + k in bits 4k.. of column c (the same file's
    qzeros packing, which stores zero - 1: the caller subtracts)."""
    return pack_gptq_rows(values.t().contiguous()).t().contiguous()


# ------------------------------------------------------------------------------------------- quantizer
def quantize(w: torch.Tensor, group_of: torch.Tensor, groups: int, sym: bool, min_zero: int = 0):
    """Round-to-nearest 4-bit of w [out, in] by group (group_of [in]): q [out, in], zeros [out, groups] (ints),
    scales [out, groups] in float16, and the dequantized weight (q - z) * s in float32."""
    out_f = w.shape[0]
    scales = torch.empty(out_f, groups)
    zeros = torch.empty(out_f, groups, dtype=torch.int64)
    for grp in range(groups):
        cols = w[:, group_of == grp]
        if sym:
            s = cols.abs().amax(dim=1) / 7.5
            z = torch.full((out_f, ), 8, dtype=torch.int64)
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            s = (hi - lo) / 15
            # GPTQ's v1 format stores zero - 1 in 4 bits: a zero of 0 would not survive it (min_zero 1)
            z = (-lo / s.clamp(min=1e-8)).round().long().clamp(min_zero, 15)
        scales[:, grp], zeros[:, grp] = s.clamp(min=1e-6), z
    scales = scales.half()
    s_full, z_full = scales.float()[:, group_of], zeros[:, group_of]
    q = ((w / s_full).round().long() + z_full).clamp(0, 15)
    return q, zeros, scales, (q - z_full).float() * s_full


def _checkpoint(src: str, out: str, dense_out: str, method: str, group: int, sym=False, desc_act=False):
    """``src``'s decoder linears in ``method``'s layout (``out``) and the same weights dequantized (``dense_out``)."""
    from safetensors.torch import load_file, save_file
    for d in (out, dense_out):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns('*.safetensors'), dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(7)
    orders = {}
    for f in [f for f in os.listdir(src) if f.endswith('.safetensors')]:
        quant, dense = {}, {}
        for name, t in load_file(os.path.join(src, f)).items():
            proj = next((n for n in LINEAR_NAMES if f'.{n}.' in name), None)
            if proj is None or not name.endswith('.weight'):
                quant[name] = dense[name] = t
                continue
            w = t.float()
            out_f, in_f = w.shape
            g = in_f if group == -1 else group
            groups = in_f // g
            group_of = torch.arange(in_f) // g
            if desc_act:  # columns quantized in another order: group j // g for the j-th column of a permutation
                key = (name.rsplit('.', 3)[0], SAME_INPUT.get(proj, proj))
                if key not in orders:
                    perm = torch.randperm(in_f, generator=gen)
                    orders[key] = torch.empty(in_f, dtype=torch.int64)
                    orders[key][perm] = torch.arange(in_f) // g
                group_of = orders[key]
            q, z, s, deq = quantize(w, group_of, groups, sym, min_zero=1 if method == 'gptq' else 0)
            base = name[:-len('weight')]
            if method == 'awq':
                quant[base + 'qweight'] = pack_awq(q.t().contiguous())
                quant[base + 'qzeros'] = pack_awq(z.t().contiguous())
            else:
                quant[base + 'qweight'] = pack_gptq_rows(q.t().contiguous())
                quant[base + 'qzeros'] = pack_gptq_cols((z - 1).t().contiguous())
                quant[base + 'g_idx'] = group_of.to(torch.int32)
            quant[base + 'scales'] = s.t().contiguous()
            dense[name] = deq.to(t.dtype)
        save_file(quant, os.path.join(out, f), metadata={'format': 'pt'})
        save_file(dense, os.path.join(dense_out, f), metadata={'format': 'pt'})
    if method == 'awq':
        qc = {'quant_method': 'awq', 'bits': 4, 'group_size': group, 'zero_point': True, 'version': 'gemm',
              'modules_to_not_convert': None}
    else:
        qc = {'quant_method': 'gptq', 'bits': 4, 'group_size': group, 'desc_act': desc_act, 'sym': sym,
              'damp_percent': 0.01, 'true_sequential': True, 'checkpoint_format': 'gptq'}
    cfg_path = os.path.join(out, 'config.json')
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg['quantization_config'] = qc
    with open(cfg_path, 'w') as fh:
        json.dump(cfg, fh)


def _decode(path, prompts, n, tp=1, model_format=None):
    from lmdeploy.engine.engine import Engine
    from lmdeploy.messages import PytorchEngineConfig
    eng = Engine(path, PytorchEngineConfig(device_type='cpu', dtype='float32', session_len=256, tp=tp,
                                           model_format=model_format))
    try:
        layer = eng.runner.model.model.layers[0].self_attn.qkv_proj if tp == 1 else None
        got = generate_all(eng, prompts, greedy(n))
    finally:
        eng.close()
    return got, layer


CASES = [  # model, method, group, sym, desc_act
    ('llama', 'awq', 32, False, False),
    ('qwen2', 'gptq', 32, True, False),
    ('llama', 'gptq', 32, False, True),
    ('qwen2', 'gptq', -1, False, False),
]


@pytest.mark.parametrize('name,method,group,sym,desc_act', CASES)
def test_checkpoint_decodes_as_its_dequantized_weights(tiny_model_factory, tmp_path, name, method, group, sym,
                                                       desc_act):
    quant, dense = str(tmp_path / method), str(tmp_path / 'dense')
    _checkpoint(tiny_model_factory(name), quant, dense, method, group, sym, desc_act)
    rng = random.Random()
    prompts = [[rng.randrange(20, 1000) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    got, layer = _decode(quant, prompts, 10, model_format=method)  # --model-format agreeing with config.json
    assert type(layer.impl).__name__ == {'awq': 'AwqLinear', 'gptq': 'GptqLinear'}[method]
    assert layer.weight_q.dtype == torch.uint8 and layer.weight_q.shape == (128, 64)  # q|k|v rows, hidden
    assert got == hf_greedy(dense, prompts, 10)


@pytest.mark.parametrize('method,group,desc_act', [('awq', 32, False), ('gptq', -1, True)])
def test_two_ranks_give_one_ranks_tokens(tiny_model_factory, tmp_path, method, group, desc_act):
    """Each rank loads its slice of the packed tensors (AWQ: 8 output rows per int32 column, a group's rows of
    the scales and zeros; GPTQ: 8 input rows per int32 row and its g_idx, the one group's scales whole on each
    rank)."""
    quant, dense = str(tmp_path / method), str(tmp_path / 'dense')
    _checkpoint(tiny_model_factory('qwen2'), quant, dense, method, group, desc_act=desc_act)
    rng = random.Random()
    prompts = [[rng.randrange(20, 1000) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    want, _ = _decode(quant, prompts, 8)
    got, _ = _decode(quant, prompts, 8, tp=2)
    assert got == want


# ------------------------------------------------------------------------------------------- unpacking
def _layer(impl_cls, config, in_f, out_f, tensors):
    from torch import nn

    from lmdeploy.devices import get_device
    layer = nn.Module()
    impl = impl_cls(get_device('cpu'), config)
    impl.create_weights(layer, in_f, out_f, False)
    for k, v in tensors.items():
        assert getattr(layer, k).shape == v.shape, k
        getattr(layer, k).data = v
    impl.process_weights(layer)
    return impl, layer


@pytest.mark.parametrize('desc_act', [False, True])
def test_unpacking_inverts_the_documented_packing(desc_act):
    from lmdeploy.devices.quant_formats import AwqLinear, GptqLinear
    g = torch.Generator().manual_seed(0)
    in_f, out_f, group = 64, 48, 16
    q = torch.randint(0, 16, (out_f, in_f), generator=g)
    z = torch.randint(1, 16, (out_f, in_f // group), generator=g)
    s = torch.rand(out_f, in_f // group, generator=g) + 0.1
    x = torch.randn(5, in_f, generator=g)
    group_of = torch.arange(in_f) // group
    if desc_act:
        group_of = group_of[torch.randperm(in_f, generator=g)]
    want_w = (q - z[:, group_of]).float() * s[:, group_of]

    if not desc_act:
        cfg = {'quant_method': 'awq', 'bits': 4, 'group_size': group, 'zero_point': True, 'version': 'gemm'}
        impl, layer = _layer(AwqLinear, cfg, in_f, out_f, {'qweight': pack_awq(q.t().contiguous()),
                                                            'qzeros': pack_awq(z.t().contiguous()),
                                                            'scales': s.t().contiguous()})
        assert torch.equal(layer.weight_q.long(), q) and torch.equal(layer.zeros.long(), z)
        torch.testing.assert_close(impl.dequantized(layer, torch.float32), want_w)
        torch.testing.assert_close(impl.apply(layer, x), x @ want_w.t())

    cfg = {'quant_method': 'gptq', 'bits': 4, 'group_size': group, 'desc_act': desc_act, 'sym': False}
    impl, layer = _layer(GptqLinear, cfg, in_f, out_f, {'qweight': pack_gptq_rows(q.t().contiguous()),
                                                         'qzeros': pack_gptq_cols((z - 1).t().contiguous()),
                                                         'scales': s.t().contiguous(),
                                                         'g_idx': group_of.to(torch.int32)})
    assert torch.equal(layer.weight_q.long(), q) and torch.equal(layer.zeros.long(), z)
    torch.testing.assert_close(impl.dequantized(layer, torch.float32), want_w)
    torch.testing.assert_close(impl.apply(layer, x), x @ want_w.t())


def test_awq_nibble_order_is_not_sequential():
    """A value in column 1 of a block lands in bits 16..19 (AWQ's order 0, 2, 4, 6, 1, ...), not bits 4..7."""
    from lmdeploy.devices.quant_formats import AWQ_ORDER as ours
    from lmdeploy.devices.quant_formats import unpack_int4
    v = torch.zeros(1, 8, dtype=torch.int64)
    v[0, 1] = 5
    packed = pack_awq(v)
    assert int(packed[0, 0]) == 5 << 16
    assert unpack_int4(packed, 1, ours).tolist() == [[0, 5, 0, 0, 0, 0, 0, 0]]
    assert unpack_int4(packed, 1).tolist() == [[0, 0, 0, 0, 5, 0, 0, 0]]


# ------------------------------------------------------------------------------------------- refusals
AWQ = {'quant_method': 'awq', 'bits': 4, 'group_size': 128, 'zero_point': True, 'version': 'gemm'}
GPTQ = {'quant_method': 'gptq', 'bits': 4, 'group_size': 128, 'desc_act': False, 'sym': True}


def test_supported_configs_name_their_format():
    assert weight_format(AWQ) == 'awq'
    assert weight_format(dict(AWQ, version='GEMM')) == 'awq'
    for g, d, s in ((128, False, True), (-1, True, False), (32, True, True)):
        assert weight_format(dict(GPTQ, group_size=g, desc_act=d, sym=s)) == 'gptq'


@pytest.mark.parametrize('config,match', [
    (dict(AWQ, bits=8), r'quantization_config.bits = 8 .*only 4-bit'),
    (dict(AWQ, version='gemv'), r"quantization_config.version = 'gemv' .*'gemm' layout"),
    (dict(AWQ, version='exllama'), r"quantization_config.version = 'exllama'"),
    (dict(AWQ, zero_point=False), r'quantization_config.zero_point = False'),
    (dict(AWQ, group_size=-1), r'quantization_config.group_size = -1'),
    (dict(AWQ, modules_to_not_convert=['visual']), r'quantization_config.modules_to_not_convert'),
    (dict(GPTQ, bits=3), r'quantization_config.bits = 3'),
    (dict(GPTQ, bits=8), r'quantization_config.bits = 8'),
    (dict(GPTQ, group_size=0), r'quantization_config.group_size = 0'),
    (dict(GPTQ, checkpoint_format='gptq_v2'), r"quantization_config.checkpoint_format = 'gptq_v2'"),
    (dict(GPTQ, checkpoint_format='marlin'), r"quantization_config.checkpoint_format = 'marlin'"),
    (dict(GPTQ, is_marlin_format=True), r'quantization_config.is_marlin_format'),
])
def test_other_configs_are_refused_by_field(config, match):
    with pytest.raises(ValueError, match=match):
        weight_format(config)


def test_a_layer_the_group_does_not_divide_is_refused():
    from torch import nn

    from lmdeploy.devices import get_device
    from lmdeploy.devices.quant_formats import AwqLinear, GptqLinear
    with pytest.raises(ValueError, match='input size is 48, not a multiple of 32'):
        AwqLinear(get_device('cpu'), dict(AWQ, group_size=32)).create_weights(nn.Module(), 48, 64, False)
    with pytest.raises(ValueError, match='output size is 44, not a multiple of 8'):
        GptqLinear(get_device('cpu'), GPTQ).create_weights(nn.Module(), 128, 44, False)


def test_a_model_format_config_json_does_not_say_is_refused(tiny_model_factory, tmp_path):
    """--model-format (LMDeploy's flag) is checked against config.json before anything loads: a float
    checkpoint named 'awq' would otherwise run unquantized without a word."""
    from lmdeploy.cli.common import add_engine_args, build_engine_config
    quant, dense = str(tmp_path / 'awq'), str(tmp_path / 'dense')
    _checkpoint(tiny_model_factory('llama'), quant, dense, 'awq', 32)
    with pytest.raises(ValueError, match=r"--model-format gptq .*/config.json says quant_method 'awq'"):
        _decode(quant, [[30, 40]], 1, model_format='gptq')
    with pytest.raises(ValueError, match=r'--model-format awq .* has no quantization_config \(plain weights\)'):
        _decode(dense, [[30, 40]], 1, model_format='awq')
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert build_engine_config(parser.parse_args(['--model-format', 'gptq'])).model_format == 'gptq'
    with pytest.raises(SystemExit):
        parser.parse_args(['--model-format', 'int3'])
    with pytest.raises(ValueError, match='PytorchEngineConfig.model_format'):
        from lmdeploy.messages import PytorchEngineConfig
        PytorchEngineConfig(model_format='int3')


def test_desc_act_groups_under_two_ranks_are_refused(tiny_model_factory, tmp_path):
    """With desc_act a rank's input columns fall in any of the groups, so each rank would need every group's
    scales, which a layer built for its columns does not size: refused by name (per channel, above, loads)."""
    quant, dense = str(tmp_path / 'gptq'), str(tmp_path / 'dense')
    _checkpoint(tiny_model_factory('qwen2'), quant, dense, 'gptq', 32, desc_act=True)
    with pytest.raises(Exception, match=r"(qzeros|scales): the checkpoint gives .* GPTQ's desc_act"):
        _decode(quant, [[30, 40, 50]], 2, tp=2)
