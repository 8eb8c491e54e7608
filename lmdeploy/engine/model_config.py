"""What the engine needs to know about a checkpoint, read from config.json.

Reads both config styles: the legacy one (``rope_theta``/``rope_scaling`` at
top level) and transformers 5's ``rope_parameters``.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .remote_config import standard_fields

DTYPES = {'float16': torch.float16, 'bfloat16': torch.bfloat16, 'float32': torch.float32}


@dataclass
class RopeConfig:
    """Rotary embedding parameters; ``type`` is one of default/linear/dynamic/llama3/longrope."""
    type: str = 'default'
    theta: float = 10000.0
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: Optional[int] = None
    # longrope (Phi-3): inv_freq divided per frequency by short_factor while the sequence is within
    # original_max_position_embeddings, by long_factor past it; cos/sin multiplied by attention_factor
    short_factor: Optional[List[float]] = None
    long_factor: Optional[List[float]] = None
    attention_factor: float = 1.0
    # rotary on the first int(head_dim * partial_rotary_factor) dims of a head (Phi-4-mini); models that
    # lay out q/k for it ask RotaryEmbedding for it, others refuse it
    partial_rotary_factor: float = 1.0


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


SUPPORTED_ROPE = ('default', 'linear', 'dynamic', 'llama3', 'longrope')


_MISSING = object()


class ConfigFields:
    """Typed reads of a checkpoint's JSON config: a field that is missing (where it is needed) or of the
    wrong kind raises ValueError naming the field and the file, instead of a KeyError or a wrong model
    later. A null value counts as absent."""

    def __init__(self, values: Dict[str, Any], path: str, prefix: str = ''):
        self.values, self.path, self.prefix = values, path, prefix

    def error(self, key: str, problem: str) -> ValueError:
        return ValueError(f'{self.path}: field {self.prefix + key!r} {problem}')

    def _get(self, key: str, default, what: str):
        value = self.values.get(key)
        if value is None:
            if default is _MISSING:
                raise self.error(key, f'is missing ({what})' if key not in self.values else f'is null ({what})')
            return default
        return value

    def integer(self, key: str, default=_MISSING, what: str = 'a positive integer', minimum: int = 1):
        value = self._get(key, default, what)
        if value is default:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(key, f'must be {what}, got {value!r}')
        return value

    def number(self, key: str, default=_MISSING, what: str = 'a positive number'):
        value = self._get(key, default, what)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self.error(key, f'must be {what}, got {value!r}')
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default, 'true or false')
        if value not in (True, False):  # (0 and 1 pass, as Python reads them)
            raise self.error(key, f'must be true or false, got {value!r}')
        return bool(value)

    def text(self, key: str, default: str = '') -> str:
        value = self._get(key, default, 'a string')
        if not isinstance(value, str):
            raise self.error(key, f'must be a string, got {value!r}')
        return value

    def mapping(self, key: str) -> Optional[Dict[str, Any]]:
        value = self._get(key, None, 'an object')
        if value is not None and not isinstance(value, dict):
            raise self.error(key, f'must be an object, got {value!r}')
        return value

    def token_ids(self, key: str) -> List[int]:
        value = self._get(key, [], 'a token id or a list of them')
        ids = value if isinstance(value, list) else [value]
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise self.error(key, f'must be a token id (an integer >= 0) or a list of them, got {value!r}')
        return ids


def _rope_from(fields: ConfigFields) -> RopeConfig:
    cfg = fields.values
    if fields.mapping('rope_parameters') is not None:
        key = 'rope_parameters'
        params = dict(cfg['rope_parameters'])
    else:
        key = 'rope_scaling'
        params = dict(fields.mapping('rope_scaling') or {})
        params.setdefault('rope_theta', cfg.get('rope_theta', 10000.0))
    # nested per-layer-type form: {"full_attention": {...}}
    if 'rope_theta' not in params and len(params) and all(isinstance(v, dict) for v in params.values()):
        layer_type, params = next(iter(params.items()))
        key = f'{key}.{layer_type}'
    rope = ConfigFields(params, fields.path, prefix=f'{key}.')
    rope_type = params.get('rope_type', params.get('type', 'default')) or 'default'
    if rope_type == 'su' or (rope_type == 'yarn' and 'long_factor' in params and 'short_factor' in params):
        rope_type = 'longrope'  # Phi-3's older names for it (transformers' Phi3Config renames them so)
    if params.get('partial_rotary_factor') is not None:
        partial = rope.number('partial_rotary_factor', what='a number in (0, 1]')
    else:
        partial = fields.number('partial_rotary_factor', 1.0, what='a number in (0, 1]')
    if partial > 1:
        where = f'{key}.partial_rotary_factor' if 'partial_rotary_factor' in params else 'partial_rotary_factor'
        raise ValueError(f'{fields.path}: field {where!r} must be a number in (0, 1], got {partial!r}')
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(f'{fields.path}: rope type {rope_type!r} ({key}) is not supported; supported: '
                         f'{list(SUPPORTED_ROPE)}')
    original = rope.integer('original_max_position_embeddings', None)
    if rope_type == 'llama3' and original is None:
        original = rope.integer('original_max_position_embeddings', what="a positive integer, for rope type 'llama3'")
    longrope = {}
    if rope_type == 'longrope':
        longrope = _longrope_from(fields, rope, original)
        original = longrope.pop('original')
    return RopeConfig(type=rope_type,
                      theta=rope.number('rope_theta', fields.number('rope_theta', 10000.0)),
                      factor=rope.number('factor', 1.0),
                      low_freq_factor=rope.number('low_freq_factor', 1.0),
                      high_freq_factor=rope.number('high_freq_factor', 4.0),
                      original_max_position_embeddings=original,
                      partial_rotary_factor=partial,
                      **longrope)


def _factor_list(rope: ConfigFields, key: str) -> List[float]:
    value = rope._get(key, _MISSING, "a list of positive numbers, for rope type 'longrope'")
    if (not isinstance(value, list) or not value
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in value)):
        raise rope.error(key, f"must be a list of positive numbers, for rope type 'longrope', got {value!r}")
    return [float(v) for v in value]


def _longrope_from(fields: ConfigFields, rope: ConfigFields, original: Optional[int]) -> Dict[str, Any]:
    """LongRoPE's fields as transformers reads them (modeling_rope_utils._compute_longrope_parameters):
    original_max_position_embeddings from the rope parameters or the top level (Phi-3 keeps it there);
    the attention factor as given, else from ``factor`` (max_position_embeddings / original when absent):
    sqrt(1 + ln(factor) / ln(original)), 1 for a factor <= 1."""
    if original is None:
        original = fields.integer('original_max_position_embeddings',
                                  what="a positive integer, for rope type 'longrope'")
    short, long = _factor_list(rope, 'short_factor'), _factor_list(rope, 'long_factor')
    if len(short) != len(long):
        raise rope.error('long_factor', f'has {len(long)} entries, short_factor {len(short)}')
    attention = rope.number('attention_factor', None)
    if attention is None:
        factor = rope.number('factor', None)
        if factor is None:
            factor = fields.integer('max_position_embeddings', 4096) / original
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(original=original, short_factor=short, long_factor=long, attention_factor=attention)


def layer_window(cfg: ModelConfig, layer_idx: int, rule: Optional[str]) -> Optional[int]:
    """Decoder layer ``layer_idx``'s sliding window (None: full attention), as the model's transformers class
    reads config.json (``sliding_window``, none where ``use_sliding_window`` is false). ``rule``: None, the
    class ignores the window (Llama); ``'all'``, every layer has it (Mistral, Phi-3); ``'layer_types'``, the
    layers ``layer_types`` marks ``sliding_attention``, or without that list those from ``max_window_layers``
    (default 28) on (Qwen2, Qwen3); ``'alternate'``, as ``layer_types`` says, else every even layer (Gemma2)."""
    window = cfg.sliding_window
    if rule is None or not window:
        return None
    if rule == 'all':
        return window
    fields = ConfigFields(cfg.raw, 'config.json')
    types = cfg.raw.get('layer_types')
    if types is not None:
        if (not isinstance(types, list) or len(types) != cfg.num_layers
                or any(t not in ('sliding_attention', 'full_attention') for t in types)):
            raise fields.error('layer_types', f"must list 'sliding_attention' or 'full_attention' for each of the "
                               f'{cfg.num_layers} layers, got {types!r}')
        return window if types[layer_idx] == 'sliding_attention' else None
    if rule == 'alternate':
        return window if layer_idx % 2 == 0 else None
    first = fields.integer('max_window_layers', 28, 'an integer >= 0', minimum=0)
    return window if layer_idx >= first else None


def _read_json(path: str) -> Dict[str, Any]:
    """A JSON object from ``path``; ValueError naming the file and the place where it does not parse."""
    try:
        with open(path, encoding='utf-8') as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f'{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}') from None
    except UnicodeDecodeError as e:
        raise ValueError(f'{path} is not UTF-8 text: {e}') from None
    if not isinstance(value, dict):
        raise ValueError(f'{path} must hold a JSON object, got {type(value).__name__}')
    return value


def _eos_ids(model_path: str, fields: ConfigFields) -> List[int]:
    ids: List[int] = []
    for i in fields.token_ids('eos_token_id'):
        if i not in ids:
            ids.append(i)
    gen_path = os.path.join(model_path, 'generation_config.json')
    if os.path.exists(gen_path):
        for i in ConfigFields(_read_json(gen_path), gen_path).token_ids('eos_token_id'):
            if i not in ids:
                ids.append(i)
    return ids


def load_model_config(model_path: str) -> ModelConfig:
    """config.json -> ModelConfig; ValueError naming the field and the file for anything missing or malformed."""
    path = os.path.join(model_path, 'config.json')
    if not os.path.isfile(path):
        raise FileNotFoundError(f'{model_path!r} has no config.json: not a Hugging Face model directory')
    cfg = _read_json(path)
    if 'text_config' in cfg and 'hidden_size' not in cfg:  # a multimodal config: its language model's fields
        text = ConfigFields(cfg, path).mapping('text_config') or {}
        cfg = {**text, **cfg}
    cfg = standard_fields(cfg, path)  # remote-code configs' own field names
    fields = ConfigFields(cfg, path)
    archs = cfg.get('architectures') or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise fields.error('architectures', f'must be a list of class names, got {archs!r}')
    num_heads = fields.integer('num_attention_heads', what='the number of attention heads, a positive integer')
    hidden = fields.integer('hidden_size', what="the model's width, a positive integer")
    num_kv_heads = fields.integer('num_key_value_heads', num_heads)
    if num_heads % num_kv_heads:
        raise fields.error('num_key_value_heads', f'must divide num_attention_heads ({num_heads}), got {num_kv_heads}')
    head_dim = fields.integer('head_dim', None)
    if head_dim is None:
        if hidden % num_heads:
            raise fields.error('head_dim', f'is missing and hidden_size ({hidden}) is not a multiple of '
                               f'num_attention_heads ({num_heads})')
        head_dim = hidden // num_heads
    dtype_name = fields.text('dtype', '') or fields.text('torch_dtype', '') or 'float32'
    sliding = fields.integer('sliding_window', None, 'an integer >= 0', minimum=0) if fields.flag('use_sliding_window', True) else None
    bos = fields.token_ids('bos_token_id')
    return ModelConfig(
        architecture=archs[0] if archs else '',
        model_type=fields.text('model_type'),
        hidden_size=hidden,
        num_layers=fields.integer('num_hidden_layers', what='the number of decoder layers, a positive integer'),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=fields.integer('intermediate_size', what="the MLP's width, a positive integer"),
        vocab_size=fields.integer('vocab_size', what='the number of token ids, a positive integer'),
        rms_norm_eps=fields.number('rms_norm_eps', 1e-6),
        max_position_embeddings=fields.integer('max_position_embeddings', 4096),
        tie_word_embeddings=fields.flag('tie_word_embeddings', False),
        dtype=DTYPES.get(dtype_name.replace('torch.', ''), torch.float32),
        rope=_rope_from(fields),
        attention_bias=fields.flag('attention_bias', False),
        mlp_bias=fields.flag('mlp_bias', False),
        eos_token_ids=_eos_ids(model_path, fields),
        bos_token_id=bos[0] if bos else None,
        sliding_window=sliding,
        raw=cfg,
    )
