import torch
from torch import nn

from lmdeploy.devices import ops


class VocabEmbedding(nn.Module):

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(ids, self.weight)


class LMHead(nn.Module):
    """hidden -> vocab logits; may share its weight with the embedding."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)

    def tie(self, embedding: VocabEmbedding):
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.linear(hidden, self.weight)
