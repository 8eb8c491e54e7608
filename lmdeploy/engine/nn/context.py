"""Per-step metadata that the attention and rotary layers read."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch


@dataclass
class StepContext:
    """Describes one forward step over a packed batch of sequences.

    Every sequence b contributes ``q_seqlens[b]`` new tokens (1 when
    decoding); after the step its cache holds ``kv_seqlens[b]`` tokens.
    """
    is_decode: bool
    q_start_loc: torch.Tensor  # [B] int64
    q_seqlens: torch.Tensor  # [B] int64
    kv_seqlens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    rope_lens: torch.Tensor  # [T] int64: length each token's sequence is rotated for (dynamic NTK)
    max_q_len: int
    max_kv_len: int
    kv_caches: List[Any]  # one KVCache per layer (lmdeploy.devices.cache), as the device laid it out
    # a prefill step's first num_decode sequences have one new token each: attention runs them as a decode batch
    num_decode: int = 0
    # the decode rows (all of a decode step's, or the first num_decode), longest context first: devices may
    # balance attention work with it
    decode_order: Optional[torch.Tensor] = None
    # set while a step is recorded in pieces (engine/piecewise.py): attention layers hand q/k/v to it instead
    # of attending, and it cuts the recording there
    pieces: Any = None
