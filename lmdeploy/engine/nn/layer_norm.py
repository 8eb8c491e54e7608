"""LayerNorm with a bias (StarCoder2, Falcon): the device's ``layer_norm`` op.

Takes an optional residual as RMSNorm does (the sum returned beside the output), so a model written for
RMSNorm's fused add (Llama's layer) runs with it unchanged; the add is a plain one here, not fused."""
import torch
from torch import nn

from .build import device_ops


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps
        self.ops = device_ops()

    def forward(self, x: torch.Tensor, residual: torch.Tensor = None):
        if residual is None:
            return self.ops.layer_norm(x, self.weight, self.bias, self.eps)
        h = x + residual
        return self.ops.layer_norm(h, self.weight, self.bias, self.eps), h
