"""Random-weight models of real shapes, with a synthetic tokenizer.

    python benchmark/random_model.py --shape llama3-8b --out /tmp/llama3-8b
    python benchmark/random_model.py --shape llama3-70b --out /tmp/llama3-70b   # streamed (below)

Weights are drawn on the GPU when there is one (an 8B model takes ~40 s to
create and save). A model larger than one GPU (``--stream``, and the 70B
shape always) is drawn a tensor at a time and written in safetensors shards
with an index, as a hub checkpoint is, never whole in memory. ``--awq GROUP``
writes the decoder layers' linears in AWQ's GEMM format instead (each drawn
weight rounded to 4 bits, as ``lite auto_awq --no-search-scale`` does without
its calibration): a 70B model in W4A16 takes ~40 GB of disk, not 140. The tokenizer
is a word-level one with one token per id ("t0", "t1", ...) so that any id
decodes; it is for benchmarks, not text.
"""
from __future__ import annotations

import argparse
import json
import os

SHAPES = {
    'llama3-8b': dict(arch='LlamaConfig', hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192),
    'qwen2-7b': dict(arch='Qwen2Config', hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, rope_theta=1000000.0,
                     max_position_embeddings=32768),
    # Mistral-7B-v0.1: every layer attends to the last 4,096 tokens (issue 37's sliding-window run)
    'mistral-7b': dict(arch='MistralConfig', hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, rope_theta=10000.0,
                       max_position_embeddings=32768, sliding_window=4096),
    # issue 36's four-GPU shape (140 GB in bf16: written streamed)
    'llama3-70b': dict(arch='LlamaConfig', hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, intermediate_size=28672, vocab_size=128256, rope_theta=500000.0,
                       max_position_embeddings=8192),
    # small shapes for end-to-end checks
    'llama-small': dict(arch='LlamaConfig', hidden_size=1024, num_hidden_layers=6, num_attention_heads=16,
                        num_key_value_heads=4, intermediate_size=2816, vocab_size=32000, rope_theta=500000.0,
                        max_position_embeddings=4096),
    'qwen2-small': dict(arch='Qwen2Config', hidden_size=896, num_hidden_layers=6, num_attention_heads=14,
                        num_key_value_heads=2, intermediate_size=2432, vocab_size=32000, rope_theta=1000000.0,
                        max_position_embeddings=4096),
}


def write_tokenizer(out: str, vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f't{i}': i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token='t0'))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(out, 'tokenizer.json'))
    with open(os.path.join(out, 'tokenizer_config.json'), 'w') as f:
        json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': 't2', 'bos_token': 't1',
                   'unk_token': 't0', 'model_max_length': 1 << 20}, f)


def make_config(shape: str, **overrides):
    """The transformers config of a shape (``overrides`` replace its fields)."""
    import transformers
    spec = dict(SHAPES[shape], **overrides)
    cls = getattr(transformers, spec.pop('arch'))
    theta = spec.pop('rope_theta')
    cfg = cls(**spec, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    cfg.rope_parameters = {'rope_type': 'default', 'rope_theta': theta}
    return cfg


def make_model(shape: str, out: str, dtype: str = 'bfloat16', seed: int = 0, tokenizer: str = None,
               **overrides) -> str:
    """``tokenizer``: a directory whose (real) tokenizer the model gets, its vocabulary size with it (for
    what needs real text, e.g. structured output's grammars); default: the synthetic one."""
    import torch
    import transformers
    real = transformers.AutoTokenizer.from_pretrained(tokenizer) if tokenizer else None
    if real is not None:
        overrides.setdefault('vocab_size', len(real))
    cfg = make_config(shape, **overrides)
    torch.manual_seed(seed)
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            draw(name, p, cfg.num_hidden_layers)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    if real is not None:
        real.save_pretrained(out)
    else:
        write_tokenizer(out, cfg.vocab_size)
    return out


def draw(name: str, p, num_layers: int, generator=None):
    """Fill parameter ``name`` in place: weights with O(1) activations, so logits are not flat."""
    if 'norm' in name:
        p.copy_(1.0 + 0.1 * p.new_empty(p.shape).normal_(generator=generator))
    elif p.ndim == 1:
        p.normal_(0, 0.05, generator=generator)
    elif 'embed_tokens' in name:
        p.normal_(0, 1.0, generator=generator)
    elif 'o_proj' in name or 'down_proj' in name:  # writes to the residual: scaled by depth
        p.normal_(0, p.shape[-1]**-0.5 / (2 * num_layers)**0.5, generator=generator)
    else:
        p.normal_(0, p.shape[-1]**-0.5, generator=generator)


def make_model_streamed(shape: str, out: str, dtype: str = 'bfloat16', seed: int = 0,
                        shard_bytes: int = 5 << 30, awq_group: int = 0, **overrides) -> str:
    """As make_model, a tensor at a time: the parameters' names and shapes come from the model built on the
    meta device; each is drawn (on the GPU where there is one), moved to the host and written into the
    current shard, which is saved once it holds ``shard_bytes``. Writes model.safetensors.index.json.

    ``awq_group``: the decoder layers' projections are written as AWQ tensors of that group size
    (``qweight``, ``qzeros``, ``scales``; round to nearest), and config.json gets the matching
    ``quantization_config``."""
    import torch
    import transformers
    from safetensors.torch import save_file
    if awq_group:
        from lmdeploy.lite.pack import awq_tensors, quantization_config, quantize
    cfg = make_config(shape, **overrides)
    cfg.dtype = dtype
    with torch.device('meta'):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    gen = torch.Generator(device=device).manual_seed(seed)
    os.makedirs(out, exist_ok=True)
    shards, current, size, total = [], {}, 0, 0

    def flush():
        nonlocal current, size
        if current:
            name = f'part-{len(shards):05d}.safetensors'
            save_file(current, os.path.join(out, name), metadata={'format': 'pt'})
            shards.append((name, list(current)))
            current, size = {}, 0

    with torch.no_grad():
        for name, meta in model.state_dict().items():
            t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            draw(name, t, cfg.num_hidden_layers, gen)
            if awq_group and '.layers.' in name and name.endswith('_proj.weight'):
                prefix = name[:-len('weight')]
                parts = {prefix + k: v for k, v in awq_tensors(*quantize(t, awq_group)).items()}
            else:
                parts = {name: t}
            for key, v in parts.items():
                current[key] = v.cpu()
                size += v.numel() * v.element_size()
                total += v.numel() * v.element_size()
            if size >= shard_bytes:
                flush()
        flush()
    weight_map = {}
    for i, (part, names) in enumerate(shards):
        final = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
        os.replace(os.path.join(out, part), os.path.join(out, final))
        weight_map.update({n: final for n in names})
    with open(os.path.join(out, 'model.safetensors.index.json'), 'w') as f:
        json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=1)
    cfg.save_pretrained(out)
    if awq_group:
        path = os.path.join(out, 'config.json')
        with open(path) as f:
            config = json.load(f)
        config['quantization_config'] = quantization_config(awq_group)
        with open(path, 'w') as f:
            json.dump(config, f, indent=2)
    write_tokenizer(out, cfg.vocab_size)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--shape', choices=sorted(SHAPES), default='llama3-8b')
    p.add_argument('--out', required=True)
    p.add_argument('--dtype', default='bfloat16')
    p.add_argument('--tokenizer', default=None, help='give the model this directory\'s tokenizer (and its '
                   'vocabulary size) instead of the synthetic word-level one')
    p.add_argument('--stream', action='store_true', help='draw and write a tensor at a time, in shards (the '
                   '70B shape always is)')
    p.add_argument('--awq', type=int, default=0, metavar='GROUP', help='write the decoder layers\' linears in '
                   'AWQ\'s format with this group size (streamed; 4-bit round to nearest)')
    args = p.parse_args()
    if args.stream or args.awq or args.shape == 'llama3-70b':
        if args.tokenizer:
            p.error('--tokenizer is not supported with a streamed model')
        print(make_model_streamed(args.shape, args.out, args.dtype, awq_group=args.awq))
    else:
        print(make_model(args.shape, args.out, args.dtype, tokenizer=args.tokenizer))


if __name__ == '__main__':
    main()
