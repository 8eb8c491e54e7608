"""What a step tells a layer's attention: where each sequence's new rows are, how long its context is, where
its blocks are. The engine's step context (engine/nn/context.py) is one of these with the engine's own fields
added; the devices' attention implementations (devices/layers.py) read only these."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMeta:
    """One forward step over a packed batch of sequences: sequence b contributes ``q_seqlens[b]`` new tokens
    (rows ``q_start_loc[b]`` on; 1 when decoding) and after the step its cache holds ``kv_seqlens[b]``
    tokens, in the blocks of ``block_tables[b]``; token t is written to cache slot ``slot_mapping[t]``."""
    is_decode: bool
    q_start_loc: torch.Tensor  # [B] int64
    q_seqlens: torch.Tensor  # [B] int64
    kv_seqlens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    max_q_len: int
    max_kv_len: int
    # a prefill step's first num_decode sequences have one new token each: attention runs them as a decode batch
    num_decode: int = 0
    # the decode rows (all of a decode step's, or the first num_decode), longest context first: devices may
    # balance attention work with it
    decode_order: Optional[torch.Tensor] = None
