import torch
from torch import nn

from .build import device_ops, layer_impl


class RMSNorm(nn.Module):
    """y = w * x / rms(x); with ``residual`` the add is fused and the sum returned. Its scale is the device's
    norm implementation's parameter (devices/layers.py)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.ops = device_ops()
        self.impl = layer_impl('norm', dense=True)
        self.impl.create_weights(self, dim)
        # 'int8' / 'fp8': the output goes to an 8-bit layer, quantized here (nn/feeds.py); None: float
        self.quantize_output = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor = None):
        if self.quantize_output is None:
            out, residual_out = self.impl.apply(self, x, self.eps, residual)
        else:
            out, residual_out = self.impl.apply_quant(self, x, self.eps, residual, self.quantize_output == 'fp8')
        return out if residual is None else (out, residual_out)

    def process_weights(self):
        self.impl.process_weights(self)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: y = (1 + w) * x / rms(x), the checkpoint storing w (around 0).

    The 1 is added once, when the weight is loaded (``weight`` holds 1 + w), so the device's ``rms_norm``
    serves it. The sum is taken in float32 as transformers' GemmaRMSNorm takes it (``1.0 +
    w.float()``), then stored in the model's dtype. In float32 this is exactly transformers' result.
    In bf16 / fp16 it is not bit for bit: transformers multiplies the float32 normalized x by the float32
    1 + w and rounds once, while ``rms_norm`` (Llama's order) rounds the normalized x to the model dtype,
    multiplies by 1 + w rounded to it and rounds the product: two more roundings, so about a third of the
    outputs differ from transformers', by at most 2 ulps (measured on random bf16 and fp16 rows of 2048,
    w ~ N(0, 0.05^2) and N(0, 0.3^2)). Matching 16-bit Gemma bit for bit would need an rms_norm that
    multiplies in float32 before it rounds (Gemma's order) on every device; not done."""

    def load_param(self, param_name: str, shard: str, src):
        if tuple(src.shape) != tuple(self.weight.shape):
            raise ValueError(f'{param_name}: checkpoint shape {src.shape} != {tuple(self.weight.shape)}')
        self.weight.data.copy_(1.0 + src.take().float())
