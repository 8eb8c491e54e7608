"""``lmdeploy lite auto_awq`` (lmdeploy/lite/): SmolLM2-135M quantized here on the cpu (8 calibration windows of
128 tokens from the start of pydoc_data.topics, group size 64: 576 is not a multiple of 128) loads through the
engine as an AWQ checkpoint and still answers Paris; its perplexity on the text's last 1,024 tokens (never
calibrated on) stays within a bound of the float model's and below plain round-to-nearest's (the same 4-bit
groups with no activation-aware scales); the packed tensors unpack (devices/quant_formats.py) to the integers
quantized; a JSONL calibration file is read; unsupported architectures and group sizes are refused by name."""
from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import engine_ppl

GROUP = 64
N_GRID = 5  # alphas 0, 0.2, ..., 0.8 (the command's 20 take four times as long)
# measured on the eval windows (README): float 13.38, RTN 17.31 (+29 %), AWQ 14.60 (+9.1 %, these 5 alphas)
MAX_AWQ_OVER_FLOAT = 1.25


@pytest.fixture(scope='module')
def quantized(smollm2_path, tmp_path_factory):
    from lmdeploy.lite import auto_awq
    root = tmp_path_factory.mktemp('lite_awq')
    kw = dict(calib_samples=4, calib_seqlen=128, w_group_size=GROUP, device='cpu', progress=False)
    awq = auto_awq(smollm2_path, str(root / 'awq'), n_grid=N_GRID, **kw)
    rtn = auto_awq(smollm2_path, str(root / 'rtn'), search_scale=False, ratio=0.0, **kw)
    return dict(awq=str(root / 'awq'), rtn=str(root / 'rtn'), summary=awq, rtn_summary=rtn)


def test_awq_output_loads_answers_and_beats_round_to_nearest(quantized, smollm2_path):
    with open(os.path.join(quantized['awq'], 'config.json')) as f:
        cfg = json.load(f)
    assert cfg['quantization_config'] == {'quant_method': 'awq', 'version': 'gemm', 'bits': 4, 'group_size': GROUP,
                                          'zero_point': True}
    for name in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja', 'generation_config.json'):
        assert os.path.isfile(os.path.join(quantized['awq'], name)), name
    assert not os.path.exists(os.path.join(quantized['awq'], '.complete'))
    # the search chose scales (alpha > 0) somewhere, and RTN none
    alphas = [a for layer in quantized['summary']['alphas'] for a in layer.values()]
    assert len(alphas) == 30 * 3 and any(a > 0 for a in alphas)
    ppl_float, _ = engine_ppl(smollm2_path, ask=False)
    ppl_rtn, _ = engine_ppl(quantized['rtn'], ask=False)
    ppl_awq, answer = engine_ppl(quantized['awq'])
    print(f'perplexity: float {ppl_float:.3f}, RTN {ppl_rtn:.3f} (+{ppl_rtn / ppl_float - 1:.1%}), '
          f'AWQ {ppl_awq:.3f} (+{ppl_awq / ppl_float - 1:.1%})')
    assert 'Paris' in answer, answer
    assert ppl_awq < ppl_rtn, (ppl_awq, ppl_rtn)
    assert ppl_awq < ppl_float * MAX_AWQ_OVER_FLOAT, (ppl_awq, ppl_float)


def test_packing_round_trips(quantized):
    """qweight / qzeros unpack (quant_formats.unpack_int4 with AWQ's order) to what pack.quantize gives for
    the same weights, and a random matrix packs and unpacks to itself."""
    from safetensors.torch import load_file

    from lmdeploy.devices.quant_formats import AWQ_ORDER, unpack_int4
    from lmdeploy.lite.pack import awq_tensors, dequantize, pack_awq, quantize
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (24, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_awq(values), 1, AWQ_ORDER), values)
    w = torch.randn(32, 128, generator=g)
    q, z, s = quantize(w, GROUP)
    assert int(q.max()) <= 15 and int(z.max()) <= 15
    assert (dequantize(q, z, s) - w).abs().max() <= s.float().max() * 0.5 + 1e-6  # within half a step
    tensors = awq_tensors(q, z, s)  # what a saved linear holds
    assert torch.equal(unpack_int4(tensors['qweight'], 1, AWQ_ORDER).t(), q)
    assert torch.equal(unpack_int4(tensors['qzeros'], 1, AWQ_ORDER).t(), z)
    assert torch.equal(tensors['scales'].t(), s)
    sd = load_file(os.path.join(quantized['awq'], 'model.safetensors'))
    qw, qz, sc = (sd[f'model.layers.0.mlp.down_proj.{k}'] for k in ('qweight', 'qzeros', 'scales'))
    assert qw.dtype == torch.int32 and qw.shape == (1536, 576 // 8)
    assert qz.shape == (1536 // GROUP, 576 // 8) and sc.shape == (1536 // GROUP, 576) and sc.dtype == torch.float16
    for packed in (qw, qz):  # every bit survives unpacking and packing again
        assert torch.equal(pack_awq(unpack_int4(packed, 1, AWQ_ORDER)), packed)
    assert 'model.layers.0.mlp.down_proj.weight' not in sd and 'lm_head.weight' not in sd  # tied embeddings


def test_calib_dataset_jsonl_and_txt(tmp_path, tokenizer):
    from lmdeploy.lite.calib import calib_tokens, default_text, read_text, windows
    rows = [{'text': 'The quick brown fox jumps over the lazy dog. ' * 20}, {'text': 'Paris is in France. ' * 30}]
    path = tmp_path / 'calib.jsonl'
    path.write_text('\n'.join(json.dumps(r) for r in rows) + '\n')
    assert read_text(str(path)) == rows[0]['text'] + '\n\n' + rows[1]['text']
    toks = calib_tokens(tokenizer, str(path), 3, 64)
    ids = tokenizer.encode(read_text(str(path)), add_special_tokens=False)
    assert toks.shape == (3, 64) and toks[0].tolist() == ids[:64] and toks[1].tolist() == ids[64:128]
    txt = tmp_path / 'calib.txt'
    txt.write_text('hello world ' * 100)
    assert read_text(str(txt)) == 'hello world ' * 100
    assert read_text(None) == default_text()
    # more windows than the text holds: later passes start elsewhere, no window repeats
    got = windows(list(range(100)), 12, 10)
    assert len(got) == 12 and len({tuple(w) for w in got}) == 12 and got[10][0] == 6
    bad = tmp_path / 'bad.jsonl'
    bad.write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match='"text"'):
        read_text(str(bad))
    with pytest.raises(FileNotFoundError):
        read_text(str(tmp_path / 'missing.jsonl'))


@pytest.mark.parametrize('name', ['llama', 'qwen3'])
def test_calib_dataset_through_the_cli(tmp_path, tiny_model_factory, name):
    """The command line, a JSONL file, a tiny Llama / Qwen3: the output loads in the engine."""
    from lmdeploy import cli
    src = tiny_model_factory(name)
    path = tmp_path / 'calib.jsonl'
    path.write_text('\n'.join(json.dumps({'text': f'Sentence number {i} about the weather in town.'})
                              for i in range(200)) + '\n')
    out = tmp_path / 'out'
    rc = cli.main(['lite', 'auto_awq', src, '--work-dir', str(out), '--calib-dataset', str(path),
                   '--calib-samples', '4', '--calib-seqlen', '64', '--w-group-size', '16', '--device', 'cpu'])
    assert rc == 0
    with open(out / 'config.json') as f:
        assert json.load(f)['quantization_config']['group_size'] == 16
    from lmdeploy.engine.engine import Engine
    from lmdeploy.messages import PytorchEngineConfig
    eng = Engine(str(out), PytorchEngineConfig(device_type='cpu', dtype='float32', session_len=64))
    eng.close()


def test_refusals(tmp_path, smollm2_path, capsys):
    from lmdeploy import cli
    from lmdeploy.lite import auto_awq
    src = tmp_path / 'gpt2'
    src.mkdir()
    (src / 'config.json').write_text(json.dumps({'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2'}))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported"):
        auto_awq(str(src), str(tmp_path / 'out'))
    # 576 input features (SmolLM2) are not a multiple of the default 128: named, with a group size that fits
    with pytest.raises(ValueError, match=r'self_attn.q_proj has 576 input features.*128.*64'):
        auto_awq(smollm2_path, str(tmp_path / 'out'), calib_samples=1, calib_seqlen=8, device='cpu')
    assert cli.main(['lite', 'auto_awq', str(src), '--work-dir', str(tmp_path / 'o'), '--device', 'cpu']) == 2
    assert 'GPT2LMHeadModel' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(['lite', 'auto_awq', str(src), '--work-dir', 'x', '--w-bits', '8'])


def test_qkv_scales_are_judged_on_the_attention_output():
    """The q/k/v group's error is the attention block's output error (AutoAWQ's module2inspect): with the float
    weights it is zero; a change to v's weights shows in it as the block's output changes; the search leaves
    q/k/v's weights as they were (the candidates are set only while the block runs)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from lmdeploy.lite import awq
    torch.manual_seed(int.from_bytes(os.urandom(4), 'little'))
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=32)
    layer = LlamaDecoderLayer(cfg, 0).eval()
    hidden = torch.randn(2, 12, 64)
    pos = torch.arange(12).expand(2, 12)
    kw = dict(position_embeddings=LlamaRotaryEmbedding(cfg)(hidden, pos), position_ids=pos)
    x = layer.input_layernorm(hidden).detach()
    inputs = {'self_attn.q_proj': x.reshape(-1, 64), 'self_attn.o_proj': torch.randn(24, 64),
              'mlp.gate_proj': torch.randn(24, 64), 'mlp.down_proj': torch.randn(24, 128)}
    grp = awq._groups(layer, inputs, [(hidden.shape, kw)])[0]
    assert grp.name == 'qkv' and grp.kind == 'attn'
    ws = [fc.weight.data.clone() for fc in grp.fcs]
    with torch.no_grad():
        want = layer.self_attn(hidden_states=x, **kw)[0]
        refs = [grp.forward(ws, grp.x, 0)]
        assert torch.equal(refs[0], want)
        assert grp.loss(ws, refs) == 0
        v2 = ws[2] + 0.1 * torch.randn_like(ws[2])
        assert grp.loss([ws[0], ws[1], v2], refs) > 0
        alpha, s, losses = grp.search(16, [0.0, 0.5])
    assert set(losses) == {0.0, 0.5} and all(v > 0 for v in losses.values())
    for fc, w in zip(grp.fcs, ws):
        assert torch.equal(fc.weight.data, w)
