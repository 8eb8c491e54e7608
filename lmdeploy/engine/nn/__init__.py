"""Building blocks for model definitions; each calls device ops."""
from .activation import SiluAndMul
from .attention import PagedAttention
from .context import StepContext
from .embedding import LMHead, VocabEmbedding
from .linear import Linear, MergedLinear, RowParallelLinear
from .norm import RMSNorm
from .rotary import RotaryEmbedding

__all__ = ['SiluAndMul', 'PagedAttention', 'StepContext', 'LMHead', 'VocabEmbedding', 'Linear', 'MergedLinear',
           'RowParallelLinear', 'RMSNorm', 'RotaryEmbedding']
