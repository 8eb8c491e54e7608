"""Full-size random-weight checkpoints of the model families, for speed runs against vLLM (issue 37).

    python benchmark/family_model.py --family gemma2-9b --out /tmp/gemma2
    python benchmark/family_model.py --family internlm2.5-7b --out /tmp/il2 --engine-layout /tmp/il2-engine

The shapes and the weights' random scheme are the GPU family test's (tests/test_cuda_families.py), so what
is timed is what that test checked against transformers. Weights are drawn on the GPU when there is one.
``--engine-layout DIR`` also writes the family's own checkpoint layout where it differs from the transformers
model the weights were drawn in (InternLM2.5: packed ``wqkv``): this engine loads that, while a peer engine
without the family's remote code loads ``--out``, the same computation in Llama's layout.
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
        print(engine_checkpoint(args.family, out, args.engine_layout))
    print(out)


if __name__ == '__main__':
    main()
