from torch import nn

from .build import device_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = cat(gate, up)."""

    def __init__(self):
        super().__init__()
        self.ops = device_ops()

    def forward(self, x):
        return self.ops.silu_and_mul(x)

    def of_projection(self, proj, x):
        """self(proj(x)) for a stacked gate|up projection, as one op (a device
        may then skip writing and re-reading the projection's output)."""
        return proj.impl.apply_silu_and_mul(proj, x)


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up for x = cat(gate, up) (Gemma's MLP: transformers' ``gelu_pytorch_tanh``)."""

    def __init__(self):
        super().__init__()
        self.ops = device_ops()

    def forward(self, x):
        return self.ops.gelu_tanh_and_mul(x)

    def of_projection(self, proj, x):
        """self(proj(x)) for a stacked gate|up projection (composed: no device fuses it yet)."""
        return self.ops.gelu_tanh_and_mul(proj(x))
