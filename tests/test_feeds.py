"""engine/nn/feeds.py on every architecture the registry knows: each block's ``feeds`` pairs name layers that exist
in it, and with SmoothQuant weights every producer that can quantize (RMSNorm, silu(gate) * up) is set to, the
others (LayerNorm, GeLU) left alone. Built on the meta device from a small config.json: no weights, no forward
(tests/test_lite_smooth_quant.py runs a quantized model end to end)."""
import json

import pytest
import torch

from lmdeploy.devices.reference import ReferenceOps
from lmdeploy.engine.model_config import load_model_config
from lmdeploy.engine.models import ARCHITECTURES, get_model_class
from lmdeploy.engine.nn import RMSNorm, SiluAndMul
from lmdeploy.engine.nn.build import building
from lmdeploy.engine.nn.feeds import link_quantized_inputs

SMOOTH_QUANT = {'quant_method': 'smooth_quant', 'quant_dtype': 'int8'}


def _model(tmp_path, arch: str, quantization_config=None):
    cfg = {'architectures': [arch], 'hidden_size': 64, 'intermediate_size': 128, 'num_attention_heads': 4,
           'num_key_value_heads': 2, 'head_dim': 16, 'num_hidden_layers': 2, 'vocab_size': 128,
           'max_position_embeddings': 256, 'rms_norm_eps': 1e-6, 'torch_dtype': 'float32'}
    if quantization_config:
        cfg['quantization_config'] = quantization_config
    (tmp_path / 'config.json').write_text(json.dumps(cfg))
    config = load_model_config(str(tmp_path))
    fmt = 'w8a8_int8' if quantization_config else 'dense'
    with torch.device('meta'), building(ReferenceOps(), fmt, quantization_config):
        return get_model_class(config)(config)


def _declared_producers(model):
    """The producers of every ``feeds`` pair in the model that can quantize (RMSNorm, SiluAndMul)."""
    found = []
    for block in model.modules():
        for producer, _ in getattr(type(block), 'feeds', ()):
            module = block.get_submodule(producer)
            if isinstance(module, (RMSNorm, SiluAndMul)):
                found.append(module)
    return found


@pytest.mark.parametrize('arch', sorted(ARCHITECTURES))
def test_every_architectures_pairs_exist_and_link(tmp_path, arch):
    dense = _model(tmp_path, arch)
    assert link_quantized_inputs(dense) == 0  # plain weights: every producer keeps its float output
    model = _model(tmp_path, arch, SMOOTH_QUANT)
    producers = _declared_producers(model)
    assert link_quantized_inputs(model) == len(producers)
    assert all(p.quantize_output == 'int8' for p in producers)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    if norms:  # an RMSNorm model: each layer's two norms before q|k|v and the MLP quantize
        assert sum(isinstance(p, RMSNorm) for p in producers) == 2 * model.config.num_layers
    # only declared producers quantize: the final norm and the post-norms (Gemma 2, GLM-4) keep float outputs
    others = [m for m in model.modules() if isinstance(m, (RMSNorm, SiluAndMul)) and m not in producers]
    assert all(m.quantize_output is None for m in others)
