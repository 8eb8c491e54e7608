"""Token embedding and LM head, split over the vocabulary under tensor
parallelism: each rank holds ``ceil(V / tp)`` rows (the last rank's tail is
padding), the embedding sums the ranks' lookups and the head gathers their
logits, or, for a greedy pick, only each rank's best logit and its id."""
from __future__ import annotations

import torch
from torch import nn

from .build import device_ops, layer_impl
from .loading import CheckpointTensor
from .parallel import tensor_parallel


class _VocabShard(nn.Module):
    """``kind``: the device's layer implementation that makes and applies the rows' parameters (plain
    weights: the checkpoint's quantization leaves these layers out)."""
    kind = ''

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        tp = tensor_parallel()
        self.vocab_size, self.tp = vocab_size, tp.size
        per = -(-vocab_size // tp.size)
        self.rows = range(min(tp.rank * per, vocab_size), min((tp.rank + 1) * per, vocab_size))
        self.ops = device_ops()
        self.impl = layer_impl(self.kind, dense=True)
        self._create(per if tp.size > 1 else vocab_size, dim)

    def _create(self, num_rows: int, dim: int):
        self.impl.create_weights(self, num_rows, dim)

    def process_weights(self):
        self.impl.process_weights(self)

    def load_param(self, param_name: str, shard: str, src: CheckpointTensor):
        if src.shape[0] != self.vocab_size:
            raise ValueError(f'{param_name}: checkpoint has {src.shape[0]} rows, expected {self.vocab_size}')
        self.weight.data[:len(self.rows)].copy_(src.take(self.rows))
        self.weight.data[len(self.rows):].zero_()


class VocabEmbedding(_VocabShard):
    kind = 'embedding'

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return self.impl.apply(self, ids)
        local = ids - self.rows.start
        mine = (local >= 0) & (local < len(self.rows))
        x = self.impl.apply(self, local.clamp(0, self.weight.shape[0] - 1))
        return self.ops.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))


class LMHead(_VocabShard):
    """hidden -> vocab logits; may share its weight with the embedding."""
    kind = 'lm_head'

    def _create(self, num_rows: int, dim: int):
        self.impl.create_weights(self, dim, num_rows, bias=False)

    def tie(self, embedding: VocabEmbedding):
        """Use the embedding's rows as the head's (both plain weights of one shape)."""
        if (self.impl.format, embedding.impl.format) != ('dense', 'dense') or set(self.param_layout) != {'weight'}:
            raise ValueError('tied embeddings need plain weights in both the embedding and the LM head')
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.impl.apply(self, hidden)
        if self.tp == 1:
            return logits
        parts = self.ops.all_gather(logits)  # [tp, T, per]
        return parts.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, :self.vocab_size].contiguous()

    def greedy(self, hidden: torch.Tensor, finish=None) -> torch.Tensor:
        """The argmax over the vocabulary of ``finish(logits)`` (an elementwise map: the model's last touch on
        its logits, e.g. a soft cap) for each row of ``hidden``: int64 [T], ties to the lowest id. Under
        tensor parallelism each rank picks in its own rows and the ranks gather two numbers a row, not
        [T, V / tp] logits each."""
        logits = self.impl.apply(self, hidden)
        if finish is not None:
            logits = finish(logits)
        if self.tp == 1:
            return self.ops.argmax(logits)
        if len(self.rows) < logits.shape[1]:  # the last rank's padding rows are no token
            logits = logits[:, :len(self.rows)].contiguous()
        local = self.ops.argmax(logits)
        best = logits.gather(1, local[:, None])[:, 0].float()
        ids = (local + self.rows.start).float()  # exact: a vocabulary is far below 2^24 ids
        parts = self.ops.all_gather(torch.stack((best, ids), dim=1))  # [tp, T, 2]
        return pick_across_shards(parts[..., 0], parts[..., 1])


def pick_across_shards(best: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """best, ids [tp, T]: each rank's best logit and its vocabulary id, ranks in vocabulary order -> the id of
    the largest per column, ties to the lowest rank (so to the lowest id, as one argmax over all rows)."""
    rank = best.argmax(dim=0)  # first maximum
    return ids.gather(0, rank[None, :])[0].to(torch.int64)
