from torch import nn

from lmdeploy.devices import ops


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = cat(gate, up)."""

    def forward(self, x):
        return ops.silu_and_mul(x)

    def of_projection(self, proj, x):
        """self(proj(x)) for a stacked gate|up projection, as one op (a device
        may then skip writing and re-reading the projection's output)."""
        return ops.linear_silu_and_mul(x, proj.weight, proj.bias)
