"""Per-step metadata that the attention and rotary layers read."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import torch

from lmdeploy.devices.attention_meta import AttentionMeta


@dataclass(kw_only=True)
class StepContext(AttentionMeta):
    """One forward step (devices/attention_meta.py's fields, which attention reads) and what the model's other
    layers read: the rotary lengths, the caches, the piecewise recorder."""
    rope_lens: torch.Tensor  # [T] int64: length each token's sequence is rotated for (dynamic NTK)
    kv_caches: List[Any]  # one KVCache per layer (lmdeploy.devices.cache), as the device laid it out
    # set while a step is recorded in pieces (engine/piecewise.py): attention layers hand q/k/v to it instead
    # of attending, and it cuts the recording there
    pieces: Any = None
