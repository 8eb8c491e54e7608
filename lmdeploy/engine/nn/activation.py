from torch import nn

from lmdeploy.devices import ops


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = cat(gate, up)."""

    def forward(self, x):
        return ops.silu_and_mul(x)
