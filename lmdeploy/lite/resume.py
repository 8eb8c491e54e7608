"""Resuming an interrupted ``lmdeploy lite`` quantization (auto_awq, auto_gptq: their searches take the time;
smooth_quant only runs the calibration windows through the model once, and does not keep partial results).

The quantizers work one decoder layer at a time. After each layer, :class:`Checkpoint` keeps in
``WORK_DIR/.lite-partial``:

* what the layer left behind: its float state as quantizing left it (norms with scales folded in, the quantized
  linears' float weights emptied), its packed tensors and its summary entry, one file a layer;
* at most once every ``interval`` seconds, the calibration inputs of the next layer. Those cost as much to
  write as a layer's weights, and they are what a restart cannot get back without redoing every layer before
  them. After the last layer only its number is kept (no layer reads its outputs).

A run given the same model, tool and arguments (``key``) restarts at the newest saved inputs. The layers before
them are loaded; the rest are redone. A different key starts over. The folder is removed once the model is
written.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

PARTIAL = '.lite-partial'
INPUTS_EVERY_S = 60.0  # how often the next layer's calibration inputs are kept


class Checkpoint:
    """Per-layer progress of one quantization into ``work_dir`` (``enabled`` False: keeps nothing)."""

    def __init__(self, work_dir: str, key: dict, enabled: bool = True, interval: Optional[float] = None):
        self.dir = os.path.join(work_dir, PARTIAL)
        self.key = json.loads(json.dumps(key, default=str))  # what a restart must match (as JSON reads it back)
        self.enabled = enabled
        self.interval = INPUTS_EVERY_S if interval is None else interval
        self._inputs_saved = 0.0

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _write(self, name: str, obj):
        tmp = self._path(name + '.tmp')
        torch.save(obj, tmp)
        os.replace(tmp, self._path(name))  # a file is whole or absent, however the run ends

    def restore(self, layers) -> Tuple[int, Optional[list], Dict[str, torch.Tensor], List[dict]]:
        """(layers done, the next layer's calibration inputs, their packed tensors, their summary entries):
        the done layers' state loaded into ``layers``. (0, None, {}, []) where there is nothing to resume."""
        nothing = 0, None, {}, []
        if not self.enabled or not os.path.isdir(self.dir):
            return nothing
        try:
            with open(self._path('key.json')) as f:
                saved_key = json.load(f)
        except (OSError, ValueError):
            saved_key = None
        if saved_key != self.key:
            print(f'{self.dir}: left by a run with other arguments; starting over', file=sys.stderr)
            shutil.rmtree(self.dir)
            return nothing
        try:
            saved = torch.load(self._path('inputs.pt'), map_location='cpu', weights_only=False)
        except (OSError, RuntimeError, EOFError):
            return nothing
        done, batches = saved['layer'], saved['batches']
        packed, summaries = {}, []
        for i in range(done):
            entry = torch.load(self._path(f'layer{i}.pt'), map_location='cpu', weights_only=False)
            _load_state(layers[i], entry['state'])
            packed.update(entry['packed'])
            summaries.append(entry['summary'])
        print(f'resuming at layer {done + 1}/{len(layers)} from {self.dir}', file=sys.stderr)
        return done, batches, packed, summaries

    def save(self, i: int, layer, packed: Dict[str, torch.Tensor], summary, next_batches: Optional[list],
             last: bool):
        """Layer ``i`` is done: its state, packed tensors and summary entry, and (now and then) the inputs of
        layer ``i + 1``."""
        if not self.enabled:
            return
        if not os.path.isdir(self.dir):
            os.makedirs(self.dir)
            with open(self._path('key.json'), 'w') as f:
                json.dump(self.key, f)
        state = {n: t.detach().to('cpu') for n, t in layer.state_dict().items()}
        self._write(f'layer{i}.pt', {'state': state, 'packed': {k: v.cpu() for k, v in packed.items()},
                                     'summary': summary})
        now = time.monotonic()
        if last or now - self._inputs_saved >= self.interval:
            # (after the last layer no layer reads them: only the count is kept)
            batches = None if next_batches is None or last else [(h.cpu(), _to_cpu(kw)) for h, kw in next_batches]
            self._write('inputs.pt', {'layer': i + 1, 'batches': batches})
            self._inputs_saved = time.monotonic()

    def done(self):
        """The model is written: nothing left to resume."""
        shutil.rmtree(self.dir, ignore_errors=True)


def to_device(batches: Optional[list], device) -> Optional[list]:
    """Restored calibration inputs on the device the quantizer runs on."""
    if batches is None:
        return None
    return [(h.to(device), _to(kw, device)) for h, kw in batches]


def _to(obj, device):
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def _to_cpu(obj):
    return _to(obj, 'cpu')


def _load_state(layer, state: Dict[str, torch.Tensor]):
    """``state`` into ``layer``, parameters of another shape (a linear's emptied weight) included."""
    params = dict(layer.named_parameters())
    for name, t in state.items():
        p = params.get(name)
        if p is not None and p.shape != t.shape:
            owner, _, attr = name.rpartition('.')
            setattr(layer.get_submodule(owner) if owner else layer, attr,
                    torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype), requires_grad=False))
    layer.load_state_dict(state, strict=True, assign=True)
    for p in layer.parameters():
        p.requires_grad_(False)
