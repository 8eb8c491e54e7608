"""SmoothQuant W8A8 (lmdeploy/devices/w8a8.py, lmdeploy/lite/smoothquant.py).

The formats: the reference linear (int8 or e4m3 products accumulated exactly, times the per-token and
per-channel scales) equals a float computation of the dequantized weights on the input quantized per token
the same way, and int8's equals an integer GEMM bit for bit. ``lite smooth_quant`` on SmolLM2-135M (cpu, 4
calibration windows of 128 tokens from the start of pydoc_data.topics, calibrated and smoothed once, written in
int8 and fp8): the outputs load through the engine from config.json alone, still answer Paris, and their
perplexity on the text's last 1,024 tokens (never calibrated on) stays within a bound of the float model's that
plain round-to-nearest W8A8 (no smoothing) does not meet."""
from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import engine_ppl

import lmdeploy.devices.layers  # noqa: F401 (imported first: it imports devices/w8a8.py, as quant_formats.py)

# measured here (README): float 13.38; int8 13.48 (+0.8 %), without the smoothing 13.86 (+3.6 %); fp8 13.66
# (+2.1 %), without the smoothing 13.97 (+4.4 %). (On the last 512 tokens alone: int8 +1.9 %, fp8 +3.4 %.)
# The bounds keep a margin and fail the unsmoothed models. (Session 46, torch 2.13 and transformers 5.24: int8
# 13.43, fp8 13.69. One alpha for all of fp8's groups gave 13.51-13.97 between 0.3 and 0.8, not monotonically;
# alpha chosen per group by the quantized group's output error on the calibration rows gave fp8 13.64 and
# int8 13.58, worse for int8, so it was not taken.)
MAX_INT8_OVER_FLOAT = 1.02
MAX_FP8_OVER_FLOAT = 1.035


# ------------------------------------------------------------------------------------------- the formats
def _layer(fmt: str, w: torch.Tensor, bias=None):
    from torch import nn

    from lmdeploy.devices.layers import REFERENCE_IMPLS
    from lmdeploy.devices.reference import ReferenceOps
    from lmdeploy.devices.w8a8 import quantize_per_channel
    impl = REFERENCE_IMPLS[('linear', fmt)](ReferenceOps())
    layer = nn.Module()
    impl.create_weights(layer, w.shape[1], w.shape[0], bias is not None)
    q, s = quantize_per_channel(w, impl.fp8)
    layer.weight.data, layer.weight_scale.data = q, s
    if bias is not None:
        layer.bias.data = bias
    impl.process_weights(layer)
    return impl, layer


@pytest.mark.parametrize('fmt', ['w8a8_int8', 'w8a8_fp8'])
def test_reference_linear_is_the_float_computation(fmt):
    from lmdeploy.devices.conformance import check_layer_impl
    from lmdeploy.devices.reference import ReferenceOps
    from lmdeploy.devices.w8a8 import quantize_per_token
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g)
    w[:, 5] *= 20  # an outlier column
    bias = torch.randn(40, generator=g)
    x = torch.randn(9, 96, generator=g)
    x[:, 7] *= 30  # an outlier channel
    impl, layer = _layer(fmt, w, bias)
    got = impl.apply(layer, x.double())
    # the float computation: the dequantized weights times the input quantized per token, dequantized
    q, a = quantize_per_token(x.double(), impl.fp8)
    x_fq = q.double() * a
    w_fq = layer.weight.double() * layer.weight_scale.double()[:, None]
    want = x_fq @ w_fq.t() + bias.double()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # not the float linear itself: the activation quantization is there to see ...
    plain = x.double() @ w_fq.t() + bias.double()
    assert (got - plain).abs().max() > 1e-4
    # ... and both stay near the unquantized product (measured: int8 4.8 %, the outlier channel costing the
    # others their precision, which is what smoothing is for; e4m3 under 6 %, its 3-bit mantissa)
    rel = float((got - (x.double() @ w.double().t() + bias)).norm() / plain.norm())
    assert rel < 0.07, rel
    assert q.dtype == (torch.float8_e4m3fn if impl.fp8 else torch.int8)
    # float32 input: the same within float32 rounding; the shape's leading dims kept
    torch.testing.assert_close(impl.apply(layer, x.reshape(3, 3, 96)).reshape(9, 40).double(), got, rtol=1e-4,
                               atol=1e-4)
    # the conformance suite's check (reference against itself and against the float computation) passes
    ok, detail = check_layer_impl(ReferenceOps(), 'linear', fmt, torch.float32)
    assert ok, detail


def test_int8_is_an_integer_gemm():
    from lmdeploy.devices.w8a8 import quantize_per_token
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 2048, generator=g)
    x = torch.randn(5, 2048, generator=g)
    impl, layer = _layer('w8a8_int8', w)
    q, a = quantize_per_token(x, False)
    acc = (q.long() @ layer.weight.long().t())  # exact integers
    want = (acc.double() * a.double() * layer.weight_scale.double()).float()
    assert torch.equal(impl.apply(layer, x), want)
    assert int(layer.weight.abs().max()) == 127 and int(q.abs().max()) == 127


def test_config_names_the_format_and_refuses_by_field():
    from lmdeploy.devices.layers import weight_format
    sq = {'quant_method': 'smooth_quant', 'quant_dtype': 'int8'}
    assert weight_format(sq) == 'w8a8_int8'
    assert weight_format(dict(sq, quant_dtype='fp8')) == 'w8a8_fp8'
    assert weight_format(dict(sq, quant_dtype='float8_e4m3fn')) == 'w8a8_fp8'
    with pytest.raises(ValueError, match=r"quantization_config.quant_dtype = 'int4'"):
        weight_format(dict(sq, quant_dtype='int4'))
    with pytest.raises(ValueError, match=r"quantization_config.activation_scheme = 'static'"):
        weight_format(dict(sq, activation_scheme='static'))


# ------------------------------------------------------------------------------------------- lite smooth_quant
@pytest.fixture(scope='module')
def quantized(smollm2_path, tmp_path_factory):
    from lmdeploy.lite.smoothquant import calibrate_and_smooth, write_quantized
    root = tmp_path_factory.mktemp('lite_sq')
    # calibrated and smoothed once, written twice (what smooth_quant does for one dtype)
    prep = calibrate_and_smooth(smollm2_path, str(root / 'int8'), calib_samples=4, calib_seqlen=128, device='cpu',
                                progress=False)
    out = {'summary': write_quantized(prep, str(root / 'int8'), 'int8')}
    write_quantized(prep, str(root / 'fp8'), 'fp8')
    out.update({k: str(root / k) for k in ('int8', 'fp8')})
    return out


def test_smooth_quant_output(quantized, smollm2_path):
    from safetensors.torch import load_file
    with open(os.path.join(quantized['fp8'], 'config.json')) as f:
        qc = json.load(f)['quantization_config']
    assert qc == {'quant_method': 'smooth_quant', 'quant_dtype': 'fp8', 'weight_scheme': 'per_channel_symmetric',
                  'activation_scheme': 'per_token_dynamic', 'smooth_alpha': 0.5}
    for name in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja', 'generation_config.json'):
        assert os.path.isfile(os.path.join(quantized['int8'], name)), name
    sd = load_file(os.path.join(quantized['int8'], 'model.safetensors'))
    w, s = sd['model.layers.0.mlp.down_proj.weight'], sd['model.layers.0.mlp.down_proj.weight_scale']
    assert w.dtype == torch.int8 and w.shape == (576, 1536) and s.dtype == torch.float32 and s.shape == (576, )
    assert sd['model.embed_tokens.weight'].dtype == torch.float32 and 'lm_head.weight' not in sd  # tied
    fp8 = load_file(os.path.join(quantized['fp8'], 'model.safetensors'))
    assert fp8['model.layers.3.self_attn.o_proj.weight'].dtype == torch.float8_e4m3fn
    # the smoothing moved something in every group (o included: shared across a KV head's query heads)
    spreads = quantized['summary']['spreads']
    assert len(spreads) == 30 and all(set(sp) == {'qkv', 'gate_up', 'down', 'o'} for sp in spreads)
    assert max(sp['qkv'] for sp in spreads) > 10
    # the float model with the factors folded in computes what it did (norm weights changed, not the function)
    base = load_file(os.path.join(smollm2_path, 'model.safetensors'))
    assert not torch.equal(sd['model.layers.0.input_layernorm.weight'], base['model.layers.0.input_layernorm.weight'])


def test_smooth_quant_perplexity_and_answer(quantized, smollm2_path):
    ppl_float, _ = engine_ppl(smollm2_path, ask=False)
    ppl_int8, ans_int8 = engine_ppl(quantized['int8'])
    ppl_fp8, ans_fp8 = engine_ppl(quantized['fp8'])
    print(f'perplexity: float {ppl_float:.3f}, int8 {ppl_int8:.3f} (+{ppl_int8 / ppl_float - 1:.2%}), fp8 '
          f'{ppl_fp8:.3f} (+{ppl_fp8 / ppl_float - 1:.2%})')
    print(f'answers: int8 {ans_int8!r}, fp8 {ans_fp8!r}')
    assert 'Paris' in ans_int8, ans_int8
    assert ppl_int8 < ppl_float * MAX_INT8_OVER_FLOAT, (ppl_int8, ppl_float)
    assert ppl_fp8 < ppl_float * MAX_FP8_OVER_FLOAT, (ppl_fp8, ppl_float)
    assert 'Paris' in ans_fp8, ans_fp8


def test_cli_and_refusals(tmp_path, tiny_model_factory, capsys):
    """The command line on a tiny Qwen2 (q/k/v biases: v's scale with its rows): the output loads."""
    from lmdeploy import cli
    src = tiny_model_factory('qwen2')
    out = tmp_path / 'out'
    rc = cli.main(['lite', 'smooth_quant', src, '--work-dir', str(out), '--quant-dtype', 'fp8', '--calib-samples',
                   '2', '--calib-seqlen', '32', '--smooth-alpha', '0.6', '--device', 'cpu'])
    assert rc == 0, capsys.readouterr().err
    assert 'W8A8 fp8' in capsys.readouterr().out
    with open(out / 'config.json') as f:
        assert json.load(f)['quantization_config']['smooth_alpha'] == 0.6
    from lmdeploy.engine.engine import Engine
    from lmdeploy.messages import PytorchEngineConfig
    Engine(str(out), PytorchEngineConfig(device_type='cpu', dtype='float32', session_len=64)).close()
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(['lite', 'smooth_quant', src, '--work-dir', 'x', '--quant-dtype', 'int4'])
    from lmdeploy.lite import smooth_quant
    with pytest.raises(ValueError, match='--smooth-alpha 1.5'):
        smooth_quant(src, str(tmp_path / 'o'), smooth_alpha=1.5)


@pytest.mark.parametrize('quant_dtype', ['int8', 'fp8'])
def test_norms_and_the_activation_quantize_for_the_w8a8_layers(tmp_path, tiny_model_factory, monkeypatch,
                                                               quant_dtype):
    """nn/feeds.py: each decoder layer's two norms and its gated activation hand the W8A8 projections after them
    their input already quantized (q|k|v, gate|up, down; o quantizes its own), and the model computes exactly
    what it does when every layer quantizes its own input."""
    from lmdeploy import PytorchEngineConfig, pipeline
    from lmdeploy.devices.act_quant import QuantizedInput
    from lmdeploy.devices.w8a8 import W8A8Linear
    from lmdeploy.engine import weights
    from lmdeploy.lite import smooth_quant
    out = str(tmp_path / quant_dtype)
    smooth_quant(tiny_model_factory('llama'), out, quant_dtype=quant_dtype, calib_samples=2, calib_seqlen=32,
                 device='cpu', progress=False)
    with open(os.path.join(out, 'config.json')) as f:
        layers = json.load(f)['num_hidden_layers']
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    windows = [torch.randint(10, 1000, (n, ), generator=g).tolist() for n in (9, 23, 40)]
    linked, inputs = [], {True: 0, False: 0}
    link, apply = weights.link_quantized_inputs, W8A8Linear.apply

    def counted(self, layer, x, with_bias=True):
        inputs[isinstance(x, QuantizedInput)] += 1
        return apply(self, layer, x, with_bias)

    monkeypatch.setattr(W8A8Linear, 'apply', counted)
    cfg = PytorchEngineConfig(device_type='cpu', dtype='float32', session_len=128)
    losses = []
    for linking in (lambda m: linked.append(link(m)), lambda m: linked.append(0)):
        monkeypatch.setattr(weights, 'link_quantized_inputs', linking)
        with pipeline(out, backend_config=cfg) as pipe:
            losses.append(pipe.get_ppl(windows))
        if not losses[1:]:
            assert inputs[True] == 3 * inputs[False] > 0, inputs
            inputs = {True: 0, False: 0}
    assert linked == [3 * layers, 0]
    assert inputs[True] == 0 < inputs[False]
    assert losses[0] == losses[1], losses
