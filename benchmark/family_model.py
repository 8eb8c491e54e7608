"""Full-size random-weight checkpoints of the model families, for speed runs against vLLM (issue 37).

    python benchmark/family_model.py --family gemma2-9b --out /tmp/gemma2
    python benchmark/family_model.py --family internlm2.5-7b --out /tmp/il2 --engine-layout /tmp/il2-engine

The shapes and the weights' random scheme are the GPU family test's (tests/test_cuda_families.py), so what
is timed is what that test checked against transformers. Weights are drawn on the GPU when there is one.
``--engine-layout DIR`` also writes the family's own checkpoint layout where it differs from the transformers
model the weights were drawn in (InternLM2.5: packed ``wqkv``): this engine loads that, while a peer engine
without the family's remote code loads ``--out``, the same computation in Llama's layout. An InternLM2
layout also gets a configuration module of its own (``auto_map``: a plain ``PretrainedConfig`` that keeps
config.json's fields), so that an engine which reads InternLM2's config through remote code (vLLM, with
``vllm_offline.py --trust-remote-code``) loads the family's own layout too.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    sys.path.insert(0, os.path.join(HERE, '..', 'tests'))
    import torch
    from test_cuda_families import FAMILIES, build_family, engine_checkpoint
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--family', required=True, choices=sorted(FAMILIES))
    p.add_argument('--out', required=True)
    p.add_argument('--layers', type=int, default=None, help="num_hidden_layers (default: the shape's own)")
    p.add_argument('--engine-layout', default=None)
    args = p.parse_args()
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    model, out = build_family(args.family, args.out, device, torch.bfloat16, tiny=False, layers=args.layers)
    del model
    gc.collect()
    if args.engine_layout:
        layout = engine_checkpoint(args.family, out, args.engine_layout)
        if layout != out:
            add_remote_config(layout)
        print(layout)
    print(out)


_REMOTE_CONFIG = '''"""{model_type}'s configuration for engines that read it through remote code: config.json's fields as they
are (written by lmdeploy's benchmark/family_model.py for random-weight checkpoints)."""
from transformers import PretrainedConfig


class {name}(PretrainedConfig):
    model_type = {model_type!r}
'''


def add_remote_config(path: str):
    """Give the checkpoint at ``path`` a configuration class of its own, named in config.json's auto_map."""
    import json
    with open(os.path.join(path, 'config.json')) as f:
        cfg = json.load(f)
    model_type = cfg['model_type']
    name = {'internlm2': 'InternLM2Config'}.get(model_type, 'RemoteConfig')
    module = f'configuration_{model_type}'
    with open(os.path.join(path, module + '.py'), 'w') as f:
        f.write(_REMOTE_CONFIG.format(model_type=model_type, name=name))
    cfg['auto_map'] = {'AutoConfig': f'{module}.{name}'}
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(cfg, f, indent=2)


if __name__ == '__main__':
    main()
