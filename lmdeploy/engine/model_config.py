"""What the engine needs to know about a checkpoint, read from config.json.

Reads both config styles: the legacy one (``rope_theta``/``rope_scaling`` at
top level) and transformers 5's ``rope_parameters``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

DTYPES = {'float16': torch.float16, 'bfloat16': torch.bfloat16, 'float32': torch.float32}


@dataclass
class RopeConfig:
    """Rotary embedding parameters; ``type`` is one of default/linear/dynamic/llama3."""
    type: str = 'default'
    theta: float = 10000.0
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: Optional[int] = None


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    rope: RopeConfig
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: List[int] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    sliding_window: Optional[int] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


SUPPORTED_ROPE = ('default', 'linear', 'dynamic', 'llama3')


def _rope_from(cfg: Dict[str, Any]) -> RopeConfig:
    params = cfg.get('rope_parameters')
    if params is None:
        params = dict(cfg.get('rope_scaling') or {})
        params.setdefault('rope_theta', cfg.get('rope_theta', 10000.0))
    # nested per-layer-type form: {"full_attention": {...}}
    if 'rope_theta' not in params and len(params) and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))
    rope_type = params.get('rope_type', params.get('type', 'default')) or 'default'
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(f'rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE)}')
    return RopeConfig(type=rope_type,
                      theta=float(params.get('rope_theta', cfg.get('rope_theta', 10000.0))),
                      factor=float(params.get('factor', 1.0)),
                      low_freq_factor=float(params.get('low_freq_factor', 1.0)),
                      high_freq_factor=float(params.get('high_freq_factor', 4.0)),
                      original_max_position_embeddings=params.get('original_max_position_embeddings'))


def _eos_ids(model_path: str, cfg: Dict[str, Any]) -> List[int]:
    ids: List[int] = []

    def add(value):
        for i in (value if isinstance(value, list) else [value]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)

    add(cfg.get('eos_token_id'))
    gen_path = os.path.join(model_path, 'generation_config.json')
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            add(json.load(f).get('eos_token_id'))
    return ids


def load_model_config(model_path: str) -> ModelConfig:
    path = os.path.join(model_path, 'config.json')
    if not os.path.isfile(path):
        raise FileNotFoundError(f'{model_path!r} has no config.json: not a Hugging Face model directory')
    with open(path) as f:
        cfg = json.load(f)
    cfg = {**cfg.get('text_config', {}), **cfg} if 'text_config' in cfg and 'hidden_size' not in cfg else cfg
    archs = cfg.get('architectures') or []
    model_type = cfg.get('model_type', '')
    num_heads = cfg['num_attention_heads']
    hidden = cfg['hidden_size']
    dtype_name = cfg.get('dtype') or cfg.get('torch_dtype') or 'float32'
    return ModelConfig(
        architecture=archs[0] if archs else '',
        model_type=model_type,
        hidden_size=hidden,
        num_layers=cfg['num_hidden_layers'],
        num_heads=num_heads,
        num_kv_heads=cfg.get('num_key_value_heads') or num_heads,
        head_dim=cfg.get('head_dim') or hidden // num_heads,
        intermediate_size=cfg['intermediate_size'],
        vocab_size=cfg['vocab_size'],
        rms_norm_eps=float(cfg.get('rms_norm_eps', 1e-6)),
        max_position_embeddings=int(cfg.get('max_position_embeddings', 4096)),
        tie_word_embeddings=bool(cfg.get('tie_word_embeddings', False)),
        dtype=DTYPES.get(str(dtype_name).replace('torch.', ''), torch.float32),
        rope=_rope_from(cfg),
        attention_bias=bool(cfg.get('attention_bias', False)),
        mlp_bias=bool(cfg.get('mlp_bias', False)),
        eos_token_ids=_eos_ids(model_path, cfg),
        bos_token_id=cfg.get('bos_token_id'),
        sliding_window=cfg.get('sliding_window') if cfg.get('use_sliding_window', True) else None,
        raw=cfg,
    )
