from torch import nn

from .build import device_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = cat(gate, up)."""

    def __init__(self):
        super().__init__()
        self.ops = device_ops()
        # 'int8' / 'fp8': the output goes to an 8-bit layer, quantized here (nn/feeds.py); None: float
        self.quantize_output = None

    def forward(self, x):
        if self.quantize_output is None:
            return self.ops.silu_and_mul(x)
        return self.ops.silu_and_mul_quant(x, self.quantize_output == 'fp8')

    def of_projection(self, proj, x):
        """self(proj(x)) for a stacked gate|up projection, as one op (a device
        may then skip writing and re-reading the projection's output), quantized
        in it too where self.quantize_output says so."""
        if self.quantize_output is None:
            return proj.impl.apply_silu_and_mul(proj, x)
        return proj.impl.apply_silu_and_mul_quant(proj, x, self.quantize_output == 'fp8')


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


# transformers' activation names (ACT2FN) -> torch's gelu ``approximate``: 'gelu' is the erf form;
# 'gelu_new' computes the tanh form by its formula, equal up to rounding
GELU_APPROXIMATE = {'gelu': 'none', 'gelu_pytorch_tanh': 'tanh', 'gelu_new': 'tanh'}


class Gelu(nn.Module):
    """gelu(x), not gated (StarCoder2's and Falcon's MLP): erf or tanh form, by transformers' name."""

    def __init__(self, act_name: str):
        super().__init__()
        if act_name not in GELU_APPROXIMATE:
            raise ValueError(f'activation {act_name!r} is not supported here; supported: {sorted(GELU_APPROXIMATE)}')
        self.approximate = GELU_APPROXIMATE[act_name]
        self.ops = device_ops()

    def forward(self, x):
        return self.ops.gelu(x, self.approximate)
