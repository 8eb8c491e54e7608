"""Producers that hand an 8-bit layer its input already quantized.

A block names, in its ``feeds``, the pairs (producer, consumer) where the producer's output is the consumer's
whole input and nothing else reads it (Llama's layer: the input norm and q|k|v, the post-attention norm and
gate|up; its MLP: the gated activation and the down projection). Once the weights are processed, each consumer's
implementation says whether it takes a per-token quantized input (devices/layers.LinearImpl.input_quantization:
SmoothQuant W8A8 does); its producer then writes the 8-bit codes and scales in the same op (the device's
rms_norm_quant / silu_and_mul_quant) instead of a 16-bit tensor the layer would read again to quantize: the
same codes (up to the order a fused norm sums in: devices/act_quant.py). A producer without a quantizing op
(LayerNorm, GeLU) keeps its float output. A block whose forward wires its layers otherwise than the class it
derives from names its own pairs (both names must exist).
"""
from __future__ import annotations

from torch import nn


def link_quantized_inputs(model: nn.Module) -> int:
    """Sets ``quantize_output`` ('int8' / 'fp8' / None) on every producer of the model's ``feeds`` pairs that
    has one; returns how many producers quantize."""
    linked = 0
    for block in model.modules():
        for producer_name, consumer_name in getattr(type(block), 'feeds', ()):
            # both must exist (a block whose forward changed names must say its own pairs)
            producer, consumer = block.get_submodule(producer_name), block.get_submodule(consumer_name)
            if not hasattr(producer, 'quantize_output'):
                continue
            producer.quantize_output = consumer.impl.input_quantization(consumer)
            linked += producer.quantize_output is not None
    return linked
