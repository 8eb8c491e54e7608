"""Test helpers: reference outputs from transformers and tiny random models.

Importable from tests as ``from helpers import hf_greedy, hf_loss`` (pytest
puts ``tests/`` on ``sys.path`` because it has no ``__init__.py``).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil

# ---------------------------------------------------------------------------
# transformers reference
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _load_hf(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir,
                                                 dtype=torch.float32)
    model.eval()
    return model


def _reset_dynamic_rope(model) -> None:
    """Undo the state that dynamic NTK rope keeps between forward calls.

    transformers' dynamic rope grows ``inv_freq`` when it sees a longer
    sequence and only resets it for sequences shorter than the original
    maximum, so a cached model's answer would depend on earlier prompts.
    """
    for mod in model.modules():
        orig = getattr(mod, 'original_inv_freq', None)
        if orig is None or not hasattr(mod, 'max_seq_len_cached'):
            continue
        mod.register_buffer('inv_freq', orig.clone(), persistent=False)
        mod.max_seq_len_cached = mod.original_max_seq_len
        if hasattr(mod, 'attention_scaling'):
            # dynamic NTK always has attention_scaling 1.0
            mod.attention_scaling = 1.0


# hf_greedy's answers: (checkpoint, its files' mtimes, prompt, max_new_tokens, ignore_eos, use_cache) -> the
# new tokens. transformers' greedy answer to one prompt depends on nothing else (one prompt at a time, no
# padding), so a test asking again for a prompt another test of the session asked about gets it from here.
_GREEDY_MEMO: dict = {}


def _checkpoint_stamp(model_dir: str) -> tuple:
    stamp = []
    for name in ('config.json', 'model.safetensors', 'generation_config.json'):
        try:
            stamp.append(os.stat(os.path.join(model_dir, name)).st_mtime_ns)
        except FileNotFoundError:
            stamp.append(None)
    return tuple(stamp)


def hf_greedy(model_dir,
              prompt_ids_list,
              max_new_tokens: int,
              *,
              ignore_eos: bool = True,
              use_cache: bool = True) -> list[list[int]]:
    """Greedy continuation of each prompt by transformers' ``generate``.

    float32, ``do_sample=False``, one prompt at a time, no padding.  With
    ``ignore_eos`` (default) the EOS token is not a stop token, so exactly
    ``max_new_tokens`` are returned (EOS may appear among them, as with an
    engine's ``ignore_eos``; it is *not* suppressed like ``min_new_tokens``
    would).  With ``ignore_eos=False`` generation stops after the first EOS
    (included in the result).

    ``use_cache=False`` recomputes the whole sequence every step; this only
    matters for dynamic NTK rope, where transformers with a KV cache rotates
    each new token with frequencies for the *current* length while cached
    keys keep the rotation they were computed with.

    Each prompt's answer is remembered for the session (keyed by the
    checkpoint's path and its files' modification times), so tests asking
    again about the same prompt do not run transformers again.

    Returns one list of new token ids per prompt.
    """
    model_dir = os.path.abspath(os.fspath(model_dir))
    stamp = _checkpoint_stamp(model_dir)
    keys = [(model_dir, stamp, tuple(int(t) for t in ids), max_new_tokens, ignore_eos, use_cache)
            for ids in prompt_ids_list]
    missing = [k for k in dict.fromkeys(keys) if k not in _GREEDY_MEMO]
    if missing:
        for k, new in zip(missing, _hf_greedy([list(k[2]) for k in missing], model_dir, max_new_tokens,
                                              ignore_eos, use_cache)):
            _GREEDY_MEMO[k] = new
    return [list(_GREEDY_MEMO[k]) for k in keys]


def _hf_greedy(prompt_ids_list, model_dir, max_new_tokens, ignore_eos, use_cache) -> list[list[int]]:
    import torch
    model = _load_hf(model_dir)
    gen_cfg = copy.deepcopy(model.generation_config)
    gen_cfg.do_sample = False
    gen_cfg.num_beams = 1
    gen_cfg.temperature = None
    gen_cfg.top_p = None
    gen_cfg.top_k = None
    gen_cfg.repetition_penalty = None
    gen_cfg.max_new_tokens = max_new_tokens
    gen_cfg.min_new_tokens = None
    gen_cfg.max_length = None
    gen_cfg.use_cache = use_cache
    eos = gen_cfg.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if gen_cfg.pad_token_id is None:
        gen_cfg.pad_token_id = (eos if isinstance(eos, int) else
                                (eos[0] if eos else 0))
    if ignore_eos:
        gen_cfg.eos_token_id = None
    else:
        gen_cfg.eos_token_id = eos
    outs = []
    for ids in prompt_ids_list:
        ids = [int(t) for t in ids]
        _reset_dynamic_rope(model)
        input_ids = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(input_ids,
                                 attention_mask=torch.ones_like(input_ids),
                                 generation_config=gen_cfg)
        new = out[0, len(ids):].tolist()
        if ignore_eos:
            assert len(new) == max_new_tokens, (len(new), max_new_tokens)
        outs.append(new)
    _reset_dynamic_rope(model)
    return outs


def hf_logits(model_dir, ids):
    """float32 logits ``[len(ids), vocab]`` of one unpadded sequence."""
    import torch
    model = _load_hf(os.path.abspath(os.fspath(model_dir)))
    _reset_dynamic_rope(model)
    input_ids = torch.tensor([[int(t) for t in ids]], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits[0]
    _reset_dynamic_rope(model)
    return logits.float()


def hf_loss(model_dir, ids) -> float:
    """Mean next-token cross-entropy transformers reports with labels=ids."""
    import torch
    model = _load_hf(os.path.abspath(os.fspath(model_dir)))
    _reset_dynamic_rope(model)
    input_ids = torch.tensor([[int(t) for t in ids]], dtype=torch.long)
    with torch.no_grad():
        loss = model(input_ids=input_ids, labels=input_ids,
                     use_cache=False).loss
    _reset_dynamic_rope(model)
    return float(loss)


# ---------------------------------------------------------------------------
# tiny random models
# ---------------------------------------------------------------------------

TINY_VOCAB = 49152  # the SmolLM2 tokenizer's
TINY_SEED = 1234
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

# Files of the default model directory that are not tokenizer files.
_NOT_TOKENIZER = {
    'config.json', 'generation_config.json', 'model.safetensors',
    'model.safetensors.index.json', 'chat_template.jinja', '.complete'
}


def _tiny_specs():
    """name -> (config class name, config kwargs)."""
    llama = dict(_COMMON, rope_theta=50000.0, tie_word_embeddings=False)
    return {
        'llama': ('LlamaConfig', llama),
        'llama_tied': ('LlamaConfig', dict(llama, tie_word_embeddings=True)),
        'llama3_rope': ('LlamaConfig',
                        dict(llama,
                             max_position_embeddings=512,
                             rope_scaling=dict(
                                 rope_type='llama3',
                                 factor=8.0,
                                 low_freq_factor=1.0,
                                 high_freq_factor=4.0,
                                 original_max_position_embeddings=64))),
        'llama_linear_rope': ('LlamaConfig',
                              dict(llama,
                                   rope_scaling=dict(rope_type='linear',
                                                     factor=2.0))),
        'llama_dynamic_rope': ('LlamaConfig',
                               dict(llama,
                                    max_position_embeddings=64,
                                    rope_scaling=dict(rope_type='dynamic',
                                                      factor=2.0))),
        'mistral': ('MistralConfig',
                    dict(_COMMON, sliding_window=None,
                         tie_word_embeddings=False)),
        'qwen2': ('Qwen2Config', dict(_COMMON, tie_word_embeddings=False)),
        'qwen3': ('Qwen3Config',
                  dict(_COMMON, tie_word_embeddings=False,
                       attention_bias=False)),
    }


def _make_config(cls_name: str, kwargs: dict):
    import transformers
    kwargs = dict(kwargs)
    rope_theta = kwargs.pop('rope_theta', None)
    rope_scaling = kwargs.pop('rope_scaling', None)
    cfg = getattr(transformers, cls_name)(**kwargs)
    # transformers 5 keeps rope settings in ``rope_parameters``.
    params = dict(getattr(cfg, 'rope_parameters', None) or {})
    if rope_scaling is not None:
        params.update(rope_scaling)
    if rope_theta is not None:
        params['rope_theta'] = rope_theta
    params.setdefault('rope_type', 'default')
    cfg.rope_parameters = params
    return cfg


def _randomize(model, seed: int) -> None:
    """Deterministic, non-degenerate random weights.

    * norm weights ~ 1 + 0.1 N(0,1); projections ~ N(0, 1/fan_in) so that
      every layer changes the residual stream; biases ~ N(0, 0.1^2);
    * untied: embeddings / lm_head ~ N(0, 0.5^2), each lm_head row scaled by a
      log-normal factor (sigma 0.5) - the heavy tail puts the top logits
      further apart, so greedy top-1/top-2 margins are several times larger
      than with plain Gaussian rows (logit std ~ 4.5);
    * tied: a large shared embedding makes the model repeat its last token
      forever, so the embedding is N(0, 0.1^2) and the final norm weight is
      scaled by 5 to keep the logit std ~ 4.
    """
    import torch
    gen = torch.Generator().manual_seed(seed)
    tied = bool(getattr(model.config, 'tie_word_embeddings', False))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if 'norm' in name:
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
                if tied and name == 'model.norm.weight':
                    val = val * 5.0
            elif 'embed_tokens' in name or 'lm_head' in name:
                val = (0.1 if tied else 0.5) * torch.randn(p.shape,
                                                           generator=gen)
                if not tied and 'lm_head' in name:
                    row = torch.exp(0.5 * torch.randn(
                        (p.shape[0], 1), generator=gen) - 0.125)
                    val = val * row
            elif p.ndim == 1:
                val = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                val = torch.randn(p.shape, generator=gen) / p.shape[-1]**0.5
            p.copy_(val.to(p.dtype))


def _copy_tokenizer(tokenizer_dir: str, out: str) -> None:
    for name in os.listdir(tokenizer_dir):
        src = os.path.join(tokenizer_dir, name)
        if name in _NOT_TOKENIZER or not os.path.isfile(src):
            continue
        if name.endswith('.safetensors') or name.endswith('.bin'):
            continue
        shutil.copyfile(src, os.path.join(out, name))
    with open(os.path.join(out, 'chat_template.jinja'), 'w') as f:
        f.write(TINY_CHAT_TEMPLATE)


def _edit_config(path: str, fn) -> None:
    cfg_path = os.path.join(path, 'config.json')
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg = fn(cfg)
    with open(cfg_path, 'w') as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write('\n')


def _to_legacy(cfg: dict) -> dict:
    """transformers<5 style: top-level rope_theta (+ rope_scaling)."""
    params = dict(cfg.pop('rope_parameters', None) or {})
    cfg['rope_theta'] = params.pop('rope_theta', 10000.0)
    rope_type = params.get('rope_type', 'default')
    if rope_type != 'default':
        params['type'] = rope_type  # old key, some loaders read this one
        cfg['rope_scaling'] = params
    else:
        cfg['rope_scaling'] = None
    return cfg


def _drop_arch(cfg: dict) -> dict:
    cfg.pop('architectures', None)
    return cfg


def build_tiny_model(name: str, out: str, tokenizer_dir: str) -> str:
    """Build one tiny random model ``name`` into directory ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    base = {
        'llama_sharded': 'llama',
        'llama_legacy_config': 'llama',
        'llama_no_arch': 'llama',
        'llama3_rope_legacy_config': 'llama3_rope',
    }.get(name, name)
    specs = _tiny_specs()
    if base not in specs:
        raise KeyError(f'unknown tiny model {name!r}; known: '
                       f'{sorted(TINY_MODEL_NAMES)}')
    cls_name, kwargs = specs[base]
    cfg = _make_config(cls_name, kwargs)
    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Variants of one base model share its weights (and so its outputs).
    _randomize(model, TINY_SEED + sorted(specs).index(base))
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    os.makedirs(out, exist_ok=True)
    if name == 'llama_sharded':
        model.save_pretrained(out, max_shard_size='200KB')
    else:
        model.save_pretrained(out)
    _copy_tokenizer(tokenizer_dir, out)
    if name in ('llama_legacy_config', 'llama3_rope_legacy_config'):
        _edit_config(out, _to_legacy)
    elif name == 'llama_no_arch':
        _edit_config(out, _drop_arch)
    return out


TINY_MODEL_NAMES = (
    'llama',
    'llama_tied',
    'llama3_rope',
    'llama_linear_rope',
    'llama_dynamic_rope',
    'mistral',
    'qwen2',
    'qwen3',
    'llama_sharded',
    'llama_legacy_config',
    'llama3_rope_legacy_config',
    'llama_no_arch',
)


def build_tiny_models(root: str, tokenizer_dir: str, names=None) -> dict:
    """Build tiny models under ``root``; returns name -> directory."""
    names = TINY_MODEL_NAMES if names is None else names
    return {
        n: build_tiny_model(n, os.path.join(root, n), tokenizer_dir)
        for n in names
    }


def benchmark_module(name):
    """A script of benchmark/ loaded as a module (they import each other by name)."""
    import importlib.util
    import sys
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmark')
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(folder, f'{name}.py'))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


# ---------------------------------------------------------------------------
# InternLM2 / InternLM3 checkpoints made from transformers models
# ---------------------------------------------------------------------------


def build_tiny_custom(out: str, tokenizer_dir: str, cls_name: str, kwargs: dict, seed: int) -> str:
    """A tiny random model of a spec not in ``_tiny_specs`` (whose seeds go by the spec's sorted index),
    randomized as the others are."""
    import torch
    from transformers import AutoModelForCausalLM
    cfg = _make_config(cls_name, kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    _copy_tokenizer(tokenizer_dir, out)
    return out


def _read_hf_dir(src: str):
    from safetensors.torch import load_file
    with open(os.path.join(src, 'config.json')) as f:
        cfg = json.load(f)
    return cfg, load_file(os.path.join(src, 'model.safetensors'))


def _rope_fields(cfg: dict, type_key: str) -> dict:
    """rope_theta and rope_scaling (or null) the legacy way, the scaling type under ``type_key``."""
    params = dict(cfg.get('rope_parameters') or {})
    theta = params.pop('rope_theta', cfg.get('rope_theta', 10000.0))
    rope_type = params.pop('rope_type', params.pop('type', 'default'))
    if rope_type == 'default':
        return dict(rope_theta=theta, rope_scaling=None)
    return dict(rope_theta=theta, rope_scaling={type_key: rope_type, **params})


def _common_fields(cfg: dict) -> dict:
    keys = ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
            'num_key_value_heads', 'max_position_embeddings', 'rms_norm_eps', 'bos_token_id', 'eos_token_id',
            'pad_token_id', 'tie_word_embeddings', 'initializer_range')
    return dict({k: cfg[k] for k in keys if k in cfg}, hidden_act='silu', torch_dtype='float32', use_cache=True)


def _write_converted(src: str, out: str, config: dict, state: dict) -> str:
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):  # tokenizer, chat template, generation_config.json
        if name not in ('config.json', 'model.safetensors') and os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, 'model.safetensors'),
              metadata={'format': 'pt'})
    with open(os.path.join(out, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return out


def pack_wqkv(q, k, v, num_kv_heads: int):
    """InternLM2's wqkv from Llama's q, k, v (weights or biases): for each KV head its query heads, then its
    k head, then its v head (the inverse of the split in InternLM's tools/convert2llama.py)."""
    import torch
    rest = q.shape[1:]
    q = q.reshape(num_kv_heads, -1, k.shape[0] // num_kv_heads, *rest)  # [kv, G, d, ...]
    k = k.reshape(num_kv_heads, 1, -1, *rest)
    v = v.reshape(num_kv_heads, 1, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def llama_to_internlm2(src: str, out: str) -> str:
    """An InternLM2 checkpoint (names, packed wqkv, config fields of InternLM2's configuration_internlm2.py)
    computing what the Llama checkpoint ``src`` does. Llama's attention_bias (q, k, v and o) is
    InternLM2's ``bias`` (wqkv and wo); InternLM2's head_dim is hidden_size / heads."""
    cfg, state = _read_hf_dir(src)
    heads, kv_heads = cfg['num_attention_heads'], cfg['num_key_value_heads']
    assert cfg.get('head_dim', cfg['hidden_size'] // heads) == cfg['hidden_size'] // heads
    assert not cfg.get('mlp_bias'), 'InternLM2 has no MLP bias'
    renames = [('model.embed_tokens.', 'model.tok_embeddings.'), ('.self_attn.o_proj.', '.attention.wo.'),
               ('.input_layernorm.', '.attention_norm.'), ('.post_attention_layernorm.', '.ffn_norm.'),
               ('.mlp.gate_proj.', '.feed_forward.w1.'), ('.mlp.up_proj.', '.feed_forward.w3.'),
               ('.mlp.down_proj.', '.feed_forward.w2.'), ('lm_head.', 'output.')]
    new = {}
    for name, t in state.items():
        if '.self_attn.q_proj.' in name:
            prefix, param = name.split('.self_attn.q_proj.')
            parts = [state[f'{prefix}.self_attn.{p}_proj.{param}'] for p in 'qkv']
            new[f'{prefix}.attention.wqkv.{param}'] = pack_wqkv(*parts, kv_heads)
            continue
        if '.self_attn.k_proj.' in name or '.self_attn.v_proj.' in name:
            continue
        for old, repl in renames:
            name = name.replace(old, repl)
        new[name] = t
    config = dict(_common_fields(cfg), architectures=['InternLM2ForCausalLM'], model_type='internlm2',
                  bias=bool(cfg.get('attention_bias', False)), attn_implementation='eager',
                  **_rope_fields(cfg, 'type'))
    return _write_converted(src, out, config, new)


def to_internlm3(src: str, out: str) -> str:
    """An InternLM3 checkpoint (Llama's names; config fields of InternLM3's configuration_internlm3.py) of
    the Llama or Qwen2 checkpoint ``src``: q, k, v biased as Qwen2's or Llama's attention_bias
    (``qkv_bias``), o_proj and the MLP as Llama's attention_bias and mlp_bias (``bias``, one flag)."""
    cfg, state = _read_hf_dir(src)
    qwen2 = cfg.get('model_type') == 'qwen2'
    qkv_bias = qwen2 or bool(cfg.get('attention_bias', False))
    bias = False if qwen2 else bool(cfg.get('attention_bias', False))
    assert bool(cfg.get('mlp_bias', False)) == bias, 'InternLM3 has one flag for o_proj and MLP biases'
    config = dict(_common_fields(cfg), architectures=['InternLM3ForCausalLM'], model_type='internlm3',
                  qkv_bias=qkv_bias, bias=bias, head_dim=cfg.get('head_dim'), attn_implementation='eager',
                  **_rope_fields(cfg, 'rope_type'))
    return _write_converted(src, out, config, dict(state))


# ---------------------------------------------------------------------------
# Phi-3 (transformers' Phi3Config: fused qkv_proj / gate_up_proj, LongRoPE)
# ---------------------------------------------------------------------------


def tiny_phi3_kwargs(longrope: bool = False, original: int = 32, seed: int = 0, partial: float = 1.0) -> dict:
    """Phi3Config kwargs of a tiny model (no sliding window); with ``longrope`` max_position_embeddings
    4 x ``original`` and short / long factors drawn uniformly from [1, 4]; ``partial``: its
    partial_rotary_factor (rotary on that part of head_dim, as Phi-4-mini)."""
    import random
    kwargs = dict(_COMMON, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None,
                  max_position_embeddings=4 * original if longrope else 512)
    if partial != 1.0:
        kwargs['partial_rotary_factor'] = partial
    if longrope:
        rng = random.Random(seed)
        half = int(_COMMON['head_dim'] * partial) // 2
        kwargs['original_max_position_embeddings'] = original
        kwargs['rope_scaling'] = dict(rope_type='longrope', original_max_position_embeddings=original,
                                      partial_rotary_factor=partial,
                                      short_factor=[rng.uniform(1, 4) for _ in range(half)],
                                      long_factor=[rng.uniform(1, 4) for _ in range(half)])
    return kwargs


def hf_greedy_fresh(model_dir, prompt_ids_list, max_new_tokens: int) -> list[list[int]]:
    """hf_greedy on a model loaded afresh (not ``_load_hf``'s cached one, not reset by
    ``_reset_dynamic_rope``, which sets ``attention_scaling`` to dynamic NTK's 1.0: LongRoPE keeps its
    own). LongRoPE's rotary state is rewritten by every forward, so one model serves all prompts."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.fspath(model_dir), dtype=torch.float32).eval()
    outs = []
    for ids in prompt_ids_list:
        input_ids = torch.tensor([[int(t) for t in ids]], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
        new = out[0, len(ids):].tolist()
        assert len(new) == max_new_tokens, (len(new), max_new_tokens)
        outs.append(new)
    return outs


def random_prompts(seed, lengths=(3, 17, 41)) -> list[list[int]]:
    """Prompts of random token ids (20 .. TINY_VOCAB - 1), one per length, drawn with ``random.Random(seed)``."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(20, TINY_VOCAB) for _ in range(n)] for n in lengths]


def lively_model(build, prompts_of=random_prompts, new_tokens: int = 16, attempts: int = 5):
    """(checkpoint, seed) of a tiny random model ``build(seed)`` writes, drawn with fresh seeds until
    transformers' greedy decoding of ``prompts_of(seed)`` is not a degenerate repeat (more than 8 distinct
    tokens over the prompts). Now and then a draw of random weights repeats a handful of tokens (a tiny
    Falcon gave 8 over 3 prompts of 16 in one CI run); comparisons on such a draw would check little, so
    that draw is replaced, not failed."""
    for _ in range(attempts):
        seed = int.from_bytes(os.urandom(2), 'little')
        path = build(seed)
        if len({t for seq in hf_greedy(path, prompts_of(seed), new_tokens) for t in seq}) > 8:
            return path, seed
    raise AssertionError(f'{attempts} random draws in a row decoded a degenerate repeat')


def save_tiny(model, out: str, tokenizer_dir: str) -> str:
    """Save a tiny transformers model with generation ids 1 / 2 / 2 (bos / eos / pad) and the tests' tokenizer
    and chat template."""
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    _copy_tokenizer(tokenizer_dir, out)
    return out


# ---------------------------------------------------------------------------
# Gemma 1 / 2 / 3 (text): RMSNorm weights stored around 0, embeddings scaled by sqrt(hidden)
# ---------------------------------------------------------------------------


def _tiny_gemma_from(cfg, seed: int, out: str, tokenizer_dir: str) -> str:
    """A tiny random Gemma-family model of transformers config ``cfg``, randomized as the tied Llama is, with
    each norm weight stored as its multiplier less 1 (Gemma's RMSNorm multiplies by 1 + w): the layers' stored
    w are ~ N(0, 0.1^2), so the (1 + w) matters."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    scale = cfg.hidden_size**0.5
    with torch.no_grad():
        # the embedding enters scaled by sqrt(hidden): stored that much smaller, the residual stream starts as
        # the tied Llama's does, and the final norm that much larger keeps the logits' scale (a larger
        # embedding makes the model repeat its last token); every norm weight (q/k norms included) stored as
        # its multiplier less 1
        model.model.embed_tokens.weight.div_(scale)
        model.model.norm.weight.mul_(scale)
        for name, p in model.named_parameters():
            if 'norm' in name:
                p.sub_(1.0)
    return save_tiny(model, out, tokenizer_dir)


def build_tiny_gemma(out: str, tokenizer_dir: str, num_kv_heads: int = 1, seed: int = 2468) -> str:
    """A tiny random GemmaForCausalLM (hidden 64, 2 layers, 4 heads of 32, tied head, gelu_pytorch_tanh)."""
    kwargs = dict(_COMMON, num_key_value_heads=num_kv_heads, head_dim=32, rope_theta=10000.0,
                  tie_word_embeddings=True, hidden_act='gelu_pytorch_tanh')
    return _tiny_gemma_from(_make_config('GemmaConfig', kwargs), seed, out, tokenizer_dir)


GEMMA2_WINDOW = 6


def build_tiny_gemma2(out: str, tokenizer_dir: str, seed: int, **overrides) -> str:
    """A tiny random Gemma2ForCausalLM: hidden 64, 3 layers (0 and 2 attend within a 6-token window, 1 fully:
    the config's default layer_types), 4 query heads of 32 over 2 KV heads, query_pre_attn_scalar 24 (not
    head_dim), attention scores soft-capped at 3 and logits at 5."""
    kwargs = dict(_COMMON, num_hidden_layers=3, head_dim=32, rope_theta=10000.0, tie_word_embeddings=True,
                  hidden_activation='gelu_pytorch_tanh', query_pre_attn_scalar=24, sliding_window=GEMMA2_WINDOW,
                  attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    return _tiny_gemma_from(_make_config('Gemma2Config', dict(kwargs, **overrides)), seed, out, tokenizer_dir)


GEMMA3_WINDOW = 6
GEMMA3_LAYER_TYPES = ['sliding_attention', 'sliding_attention', 'full_attention', 'sliding_attention']


def build_tiny_gemma3(out: str, tokenizer_dir: str, seed: int) -> str:
    """A tiny random Gemma3ForCausalLM (text): hidden 64, 4 layers with sliding_window_pattern 3 (layers 0, 1
    and 3 attend within a 6-token window, layer 2 fully), 4 query heads of 32 over 2 KV heads,
    query_pre_attn_scalar 24, q/k norms, local rotary base 100 and global base 10,000 with linear scaling x4,
    no soft caps."""
    from transformers import Gemma3TextConfig
    cfg = Gemma3TextConfig(**dict(_COMMON, num_hidden_layers=4, head_dim=32, tie_word_embeddings=True,
                                  hidden_activation='gelu_pytorch_tanh', query_pre_attn_scalar=24,
                                  sliding_window=GEMMA3_WINDOW, sliding_window_pattern=3, rope_theta=10000.0,
                                  rope_local_base_freq=100.0, rope_scaling={'rope_type': 'linear', 'factor': 4.0}))
    assert cfg.layer_types == GEMMA3_LAYER_TYPES and cfg.attn_logit_softcapping is None
    return _tiny_gemma_from(cfg, seed, out, tokenizer_dir)


# ---------------------------------------------------------------------------
# Falcon and StarCoder2 (LayerNorms with biases)
# ---------------------------------------------------------------------------


def _randomize_falcon(model, seed: int):
    """As _randomize, with Falcon's names: LayerNorm weights ~ 1 + 0.1 N(0,1) and their biases ~ N(0, 0.1^2),
    the final norm x5 over a small tied embedding."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if '.ln_' in name or 'layernorm' in name or name.startswith('transformer.ln_f'):
                val = (1.0 + 0.1 * torch.randn(p.shape, generator=gen)) if name.endswith('weight') else (
                    0.1 * torch.randn(p.shape, generator=gen))
                if tied and name == 'transformer.ln_f.weight':
                    val = val * 5.0
            elif 'word_embeddings' in name or 'lm_head' in name:
                val = (0.1 if tied else 0.5) * torch.randn(p.shape, generator=gen)
            elif p.ndim == 1:
                val = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                val = torch.randn(p.shape, generator=gen) / p.shape[-1]**0.5
            p.copy_(val)


def build_tiny_falcon(out: str, tokenizer_dir: str, kwargs: dict, seed: int) -> str:
    """A tiny random FalconForCausalLM of FalconConfig(**kwargs)."""
    import torch
    from transformers import AutoModelForCausalLM
    cfg = _make_config('FalconConfig', kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize_falcon(model, seed)
    return save_tiny(model, out, tokenizer_dir)


def build_tiny_starcoder2(out: str, tokenizer_dir: str, kwargs: dict, seed: int) -> str:
    """A tiny random Starcoder2ForCausalLM of Starcoder2Config(**kwargs), randomized by _randomize with the
    LayerNorms' biases ~ N(0, 0.1^2) (not ~1)."""
    import torch
    from transformers import AutoModelForCausalLM
    cfg = _make_config('Starcoder2Config', kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'norm' in name and name.endswith('.bias'):  # _randomize gives every norm parameter ~1
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return save_tiny(model, out, tokenizer_dir)


def edited_copy(src: str, dst: str, edit=None, **changes) -> str:
    """A copy of checkpoint ``src`` at ``dst`` whose config.json has ``changes`` and then ``edit(config)``
    (which edits the dict in place) applied."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, 'config.json')) as f:
        cfg = json.load(f)
    cfg.update(changes)
    if edit is not None:
        edit(cfg)
    with open(os.path.join(dst, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    return dst


def import_npu_emulation():
    """tests/npu_emulation's ``activate`` module (its torch_npu emulation, off until ``activate()``)."""
    import sys
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'npu_emulation')
    sys.path.insert(0, here)
    try:
        import activate
    finally:
        sys.path.remove(here)
    return activate


def sigint_as_in_a_terminal():
    """preexec_fn for a child that a test interrupts with SIGINT: a shell starts background jobs (a CI
    runner's, or `.ci/run &`) with SIGINT ignored, which children inherit, and Python then never raises
    KeyboardInterrupt; a terminal's user has it at its default."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def here_cuda_ops(dtype=None, device=None):
    """The cuda device's ops on this process's tensors: on cpu tensors (no GPU), its Triton kernels in the
    interpreter (the test module sets TRITON_INTERPRET before importing triton). ``dtype``: the one its
    conformance checks run in (default float16 on a GPU, float32 on the cpu)."""
    import torch

    from lmdeploy.devices.cuda.ops import CudaOps
    on_gpu = torch.cuda.is_available()
    dev = torch.device(device or ('cuda' if on_gpu else 'cpu'))
    dtype = dtype or (torch.float16 if on_gpu else torch.float32)

    class Here(CudaOps):
        def torch_device(self):
            return dev

        def synchronize(self):
            pass

        def supports_dtype(self, dt):
            return dt == dtype

    return Here(num_sms=132)


# what the lite tests score quantized models on: the last 1,024 tokens of pydoc_data.topics (never calibrated on:
# calibration reads from the text's start), in windows of 512
LITE_EVAL_TOKENS, LITE_WINDOW = 1024, 512
_ENGINE_PPL: dict = {}


# The question a quantized SmolLM2 must still answer with Paris. Not the README's plain "What is the capital of
# France?": there the float model's first answer token is a coin toss ("The" 25.33 against "L" 25.24, the start
# of "L'Étoile, ..."; transformers, float32), which any 8-bit rounding may turn over (fp8 and int8 W8A8 did at
# some smoothing strengths, with perplexities within 1-4 % of float's). Asked for one word, its lead is 1.47
# ("The" 31.76 against "A" 30.29), so a quantized model that loses Paris has lost more than rounding noise.
QUANTIZED_QUESTION = 'What is the capital of France? Answer in one word.'


def engine_ppl(path: str, ask: bool = True):
    """(perplexity over the lite eval windows, the greedy answer to Paris's question or None) through the engine
    (cpu, float32). Remembered for the session per checkpoint (its files' modification times), so the float
    model every quantizer's test compares with is scored once."""
    import math

    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from lmdeploy.lite.calib import default_text
    key = (os.path.abspath(path), _checkpoint_stamp(path))
    known = _ENGINE_PPL.get(key)
    if known is not None and (known[1] is not None or not ask):
        return known[0], known[1] if ask else None
    cfg = PytorchEngineConfig(device_type='cpu', dtype='float32', session_len=LITE_WINDOW + 8)
    with pipeline(path, backend_config=cfg) as pipe:
        ids = pipe.tokenizer.encode(default_text(), add_special_tokens=False)[-LITE_EVAL_TOKENS:]
        windows = [ids[i:i + LITE_WINDOW] for i in range(0, len(ids), LITE_WINDOW)]
        losses = pipe.get_ppl(windows)
        answer = pipe([QUANTIZED_QUESTION], GenerationConfig(max_new_tokens=16))[0].text if ask else None
    n = sum(len(w) - 1 for w in windows)
    ppl = math.exp(sum(loss * (len(w) - 1) for loss, w in zip(losses, windows)) / n)
    _ENGINE_PPL[key] = (ppl, answer)
    return ppl, answer
