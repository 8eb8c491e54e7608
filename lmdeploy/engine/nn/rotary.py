"""Rotary position embedding: the frequency schedules that configs name.

cos/sin are computed in float32 from ``position * inv_freq`` (as
transformers does), once a step; the attention layers apply them
(``rotary_fill_kv``) as they write K/V.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..model_config import RopeConfig
from .build import layer_impl


def base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    # explicit cpu: models are built under a meta device context
    return 1.0 / (theta**(torch.arange(0, dim, 2, dtype=torch.int64, device='cpu').float() / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: slow frequencies divided by ``factor``, fast ones kept,
    the band between interpolated smoothly."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def longrope_inv_freq(dim: int, theta: float, factors) -> torch.Tensor:
    """LongRoPE: each frequency divided by its factor, rounded as transformers computes it
    (1 / (factor * theta**(2i/d)) in float32)."""
    if len(factors) != dim // 2:
        raise ValueError(f'longrope factors: {len(factors)} given, head_dim {dim} needs {dim // 2}')
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device='cpu').float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device='cpu') * theta**exponent)


def partial_rotary_order(head_dim: int, rotary_dim: int):
    """Where each dim of a head goes so that rotary on its first ``rotary_dim`` dims (pairs i, i + rotary_dim / 2)
    becomes the ops' whole-head rotate_half (pairs j, j + head_dim / 2), the other dims passed through with
    cos 1, sin 0: new dim j holds old dim order[j]. q and k both permuted so leave q.k unchanged."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return (list(range(0, r)) + list(range(rotary_dim, rotary_dim + p)) + list(range(r, rotary_dim)) +
            list(range(rotary_dim + p, head_dim)))


def interleaved_rotary_order(head_dim: int, rotary_dim: int):
    """As partial_rotary_order, for rotary on the interleaved pairs (2i, 2i + 1) of the first ``rotary_dim`` dims
    (GLM's: pair i turns by frequency i): the even dims of that part are gathered in front of the odd ones, which
    makes the pairs i, i + rotary_dim / 2, then partial_rotary_order moves them where the ops rotate. New dim j
    holds old dim order[j]; q and k both permuted so leave q.k unchanged."""
    half = rotary_dim // 2
    split = [2 * i for i in range(half)] + [2 * i + 1 for i in range(half)] + list(range(rotary_dim, head_dim))
    return [split[j] for j in partial_rotary_order(head_dim, rotary_dim)]


def rotary_partial_dim(head_dim: int, rope: RopeConfig) -> int:
    """Rotated dims of a head: int(head_dim * partial_rotary_factor), as transformers takes them."""
    dim = int(head_dim * rope.partial_rotary_factor)
    if dim <= 0 or dim % 2:
        raise ValueError(f'partial_rotary_factor {rope.partial_rotary_factor} of head_dim {head_dim} gives '
                         f'{dim} rotary dims; an even number > 0 is needed')
    return dim


class RotaryEmbedding(nn.Module):
    """``partial_layout``: the model lays q and k out as partial_rotary_order says (config's
    partial_rotary_factor < 1); without it such a config is refused."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_position_embeddings: int, partial_layout: bool = False):
        super().__init__()
        self.impl = layer_impl('rotary', dense=True)  # the device's (devices/layers.py)
        self.impl.create_weights(self)
        self.head_dim = head_dim
        self.rope = rope
        self.max_pos = max_position_embeddings
        self.rotary_dim = rotary_partial_dim(head_dim, rope)
        if self.rotary_dim != head_dim and not partial_layout:
            raise ValueError(f'partial_rotary_factor {rope.partial_rotary_factor} (rotary on {self.rotary_dim} of '
                             f'head_dim {head_dim}) is not supported for this model')
        dim = self.rotary_dim
        if dim != head_dim and rope.type not in ('default', 'longrope'):
            raise ValueError(f'partial_rotary_factor with rope type {rope.type!r} is not supported')
        inv_freq = base_inv_freq(dim, rope.theta)
        if rope.type == 'linear':
            inv_freq = inv_freq / rope.factor
        elif rope.type == 'llama3':
            inv_freq = llama3_inv_freq(inv_freq, rope)
        elif rope.type == 'longrope':
            inv_freq = longrope_inv_freq(dim, rope.theta, rope.short_factor)
            self.long_inv_freq = longrope_inv_freq(dim, rope.theta, rope.long_factor)
        self.inv_freq = inv_freq  # not a buffer: survives materialising the model

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        return self.inv_freq

    def _dynamic_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Dynamic NTK: past the trained length the base grows with the
        sequence's length. Returns [T, D/2]."""
        d, f, m = self.head_dim, self.rope.factor, self.max_pos
        seq = seq_lens.double().clamp(min=m)
        base = self.rope.theta * ((f * seq / m) - (f - 1))**(d / (d - 2))
        exponent = torch.arange(0, d, 2, dtype=torch.int64, device=seq.device).float() / d
        return 1.0 / (base.float()[:, None]**exponent[None, :])

    def _longrope_inv_freq(self, rope_lens: torch.Tensor) -> torch.Tensor:
        """LongRoPE: the long factors for a token whose sequence is longer than the original trained length,
        the short ones otherwise. transformers picks by max(position_ids) + 1 of each forward: the prompt's
        length for its prefill, position + 1 for a decoded token: the ``rope_lens`` the engine passes (the
        sequence's length). Returns [T, D/2]."""
        short = self._inv_freq_on(rope_lens.device)
        if self.long_inv_freq.device != short.device:
            self.long_inv_freq = self.long_inv_freq.to(short.device)
        is_long = (rope_lens > self.rope.original_max_position_embeddings)[:, None]
        return torch.where(is_long, self.long_inv_freq[None, :], short[None, :])

    def cos_sin(self, positions: torch.Tensor, rope_lens: torch.Tensor):
        """positions [T]; rope_lens [T] (the length its sequence is rotated
        for, used by dynamic NTK and LongRoPE). Returns cos, sin [T, D] float32 (the device's rotary
        implementation makes them from this rope type's frequencies: devices/layers.py)."""
        if self.rope.type == 'dynamic':
            inv_freq = self._dynamic_inv_freq(rope_lens)
        elif self.rope.type == 'longrope':
            inv_freq = self._longrope_inv_freq(rope_lens)
        else:
            inv_freq = self._inv_freq_on(positions.device)
        return self.impl.apply(self, positions, inv_freq, self.head_dim, self.rope.attention_factor)
