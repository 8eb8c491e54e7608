"""Baichuan2-7B (``BaichuanForCausalLM``) and Baichuan-7B (``BaiChuanForCausalLM``): Llama's computation
(multi-head attention, RoPE with base 10000, SiLU-gated MLP) with q, k and v packed in one tensor.

    checkpoint                         here (Llama's)
    self_attn.W_pack                   q rows (hidden), then k rows, then v rows (hidden each)
    lm_head (Baichuan2: NormHead)      logits = h W^T with every row of W divided by its L2 norm

Baichuan's modeling files split ``W_pack``'s output so (``unflatten(-1, (3, hidden_size))``: q, k, v); it is
unpacked on load into views of its rows (a tensor-parallel rank reads only its heads' rows). Baichuan2's NormHead
normalises the head's rows (``F.normalize(weight)``) at its first forward in inference; they are normalised here
as they load, in float32, then stored in the model's dtype (each row on its own, so a rank's rows need no
other's). Baichuan-7B's head is a plain linear map.

Baichuan2-13B and Baichuan-13B (hidden_size 5120; the same architecture name) replace rotary with ALiBi
(models/alibi.py: the bias m_h (j - p) added to the scaled scores, as their modeling files add slopes times key
positions to the mask). Which is which is known by size only (no config field says it); vLLM and LMDeploy tell
them apart the same way.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from ..model_config import ModelConfig
from ..nn.loading import CheckpointTensor
from .alibi import AlibiAttention, drop_rotary
from .llama import LlamaForCausalLM
from .phi3 import split_rows

ALIBI_HIDDEN_SIZE = 5120  # Baichuan-13B and Baichuan2-13B


class UnitRows:
    """A checkpoint tensor whose rows are read divided by their L2 norm (NormHead's weight)."""

    def __init__(self, src: CheckpointTensor):
        self.src = src

    @property
    def shape(self):
        return self.src.shape

    def take(self, rows: Optional[range] = None, cols: Optional[range] = None) -> torch.Tensor:
        if cols is not None:
            raise ValueError('a normalised head is read by whole rows')
        w = self.src.take(rows)
        return F.normalize(w.float(), dim=-1).to(w.dtype)


class BaichuanForCausalLM(LlamaForCausalLM):
    norm_head = True  # Baichuan2's NormHead

    def __init__(self, cfg: ModelConfig):
        alibi = cfg.hidden_size == ALIBI_HIDDEN_SIZE
        if alibi:
            self.attention_cls = AlibiAttention
        super().__init__(cfg)
        if alibi:
            drop_rotary(self)

    def checkpoint_names(self, weights: Iterable[Tuple[str, CheckpointTensor]]) -> Iterator[Tuple[str, object]]:
        """W_pack into q_proj, k_proj and v_proj; the head's rows normalised (Baichuan2)."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for name, src in weights:
            if isinstance(src, torch.Tensor):
                src = CheckpointTensor(src)
            if '.self_attn.W_pack.' in name:
                prefix, param = name.split('.self_attn.W_pack.')
                for part, rows in split_rows(src, {'q': q, 'k': kv, 'v': kv}, name).items():
                    yield f'{prefix}.self_attn.{part}_proj.{param}', rows
            elif name == 'lm_head.weight' and self.norm_head:
                yield name, UnitRows(src)
            else:
                yield name, src

    def load_weights(self, weights: Iterable[Tuple[str, CheckpointTensor]]):
        super().load_weights(self.checkpoint_names(weights))


class BaiChuanForCausalLM(BaichuanForCausalLM):
    """Baichuan-7B (v1): the same layout, a plain LM head."""
    norm_head = False
