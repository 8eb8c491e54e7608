"""ALiBi attention (Press et al., "Train Short, Test Long"): no rotary; each head adds m_h (j - p) to the score
of query position p for key position j, m_h a fixed geometric slope (nn/attention.alibi_slopes). Baichuan-13B
adds it to the scaled scores (m_h as is); Falcon-RW (transformers' Falcon with ``alibi``, its SDPA path) scales
it with them (m_h / sqrt(head_dim)). A rank holds its heads' slopes."""
from __future__ import annotations

from ..model_config import ModelConfig
from ..nn.attention import alibi_slopes
from ..nn.parallel import head_shard, tensor_parallel
from .llama import LlamaAttention


class AlibiAttention(LlamaAttention):
    scaled_slopes = False  # True: slopes times the scores' factor 1 / sqrt(head_dim) (Falcon-RW)

    def attention_options(self, cfg: ModelConfig, layer_idx: int) -> dict:
        tp = tensor_parallel()
        heads, _ = head_shard(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.size)
        factor = cfg.head_dim**-0.5 if self.scaled_slopes else 1.0
        slopes = alibi_slopes(cfg.num_heads)
        return dict(super().attention_options(cfg, layer_idx), alibi_slopes=[slopes[h] * factor for h in heads])


class ScaledAlibiAttention(AlibiAttention):
    scaled_slopes = True


def drop_rotary(model):
    """An ALiBi model's forward passes no cos / sin (its attention fills the cache unrotated)."""
    model.model.rotary_emb = None
