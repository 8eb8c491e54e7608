"""``lmdeploy lite calibrate MODEL --work-dir OUT``: what each decoder linear reads, per input channel.

The decoder runs one layer at a time on the calibration windows (float; each layer's outputs are the next
one's inputs, as in the quantizers), and for the input of every decoder linear (q/k/v, o, gate/up, down) the
statistics over all calibration tokens are kept per channel: ``absmax`` (max |x|), ``absmean`` (mean |x|),
``max``, ``min`` and ``mean``. They are saved as ``OUT/inputs_stats.pt`` (torch.save of {statistic:
{'model.layers.{i}.{linear}': float32 [in_features]}}) with ``OUT/calibration.json`` (the model, the text,
windows and tokens). LMDeploy's calibrate writes the same statistics (its ``inputs_stats.pth``).

``lmdeploy lite smooth_quant --calib-stats OUT`` reads the maxima from there instead of running the
calibration again (its smoothing factors need only ``absmax``): calibrate once, quantize with several
settings.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch

from .common import LINEARS, Prepared, run_layer
from .common import progress as layer_progress

STATS_FILE = 'inputs_stats.pt'
STATISTICS = ('absmax', 'absmean', 'max', 'min', 'mean')


class _Running:
    """Per-channel statistics of the rows seen so far (float64 sums, so long calibrations stay exact)."""

    def __init__(self):
        self.n = 0
        self.absmax = self.max = self.min = self.sum = self.abssum = None

    def add(self, x: torch.Tensor):
        x = x.detach().double()
        parts = (x.abs().amax(0), x.amax(0), x.amin(0), x.sum(0), x.abs().sum(0))
        if self.n == 0:
            self.absmax, self.max, self.min, self.sum, self.abssum = parts
        else:
            self.absmax = torch.maximum(self.absmax, parts[0])
            self.max = torch.maximum(self.max, parts[1])
            self.min = torch.minimum(self.min, parts[2])
            self.sum, self.abssum = self.sum + parts[3], self.abssum + parts[4]
        self.n += x.shape[0]

    def result(self) -> Dict[str, torch.Tensor]:
        return {'absmax': self.absmax, 'absmean': self.abssum / self.n, 'max': self.max, 'min': self.min,
                'mean': self.sum / self.n}


@torch.no_grad()
def calibrate(model: Optional[str], work_dir: str, calib_dataset: Optional[str] = None, calib_samples: int = 128,
              calib_seqlen: int = 2048, batch_size: int = 1, device: str = 'auto', progress: bool = True) -> dict:
    """Record the inputs' statistics of every decoder linear of ``model`` (a local Hugging Face directory of a
    Llama, Mistral, Qwen2 or Qwen3 model) into ``work_dir``: see the module's docstring. Returns a summary."""
    prep = Prepared(model, work_dir, 'calibrate', calib_dataset, calib_samples, calib_seqlen, batch_size, None,
                    None, device)
    dev, layers, batches = prep.device, prep.layers, prep.batches
    stats: Dict[str, Dict[str, torch.Tensor]] = {s: {} for s in STATISTICS}
    for i in layer_progress(len(layers), progress, 'calibrate'):
        layer = layers[i].to(dev)
        running = {name: _Running() for name in LINEARS}
        outs = run_layer(layer, batches, {name: running[name].add for name in LINEARS},
                         outputs=i + 1 < len(layers))
        batches = [(o, kw) for o, (_, kw) in zip(outs, batches)]
        for name, r in running.items():
            for stat, value in r.result().items():
                stats[stat][f'model.layers.{i}.{name}'] = value.float().cpu()
        layers[i] = layer.to('cpu')
    os.makedirs(work_dir, exist_ok=True)
    torch.save(stats, os.path.join(work_dir, STATS_FILE))
    summary = prep.summary(None, calib_dataset=calib_dataset or 'pydoc_data.topics', calib_samples=calib_samples,
                           calib_seqlen=calib_seqlen, model=prep.model_path)
    with open(os.path.join(work_dir, 'calibration.json'), 'w') as f:
        json.dump({k: v for k, v in summary.items() if k not in ('seconds', 'group_size')}, f, indent=2)
    return summary


def load_absmax(path: str, num_layers: int, names, sizes: Dict[str, int]) -> Dict[int, Dict[str, torch.Tensor]]:
    """Per layer, ``{linear: absmax [in]}`` for ``names`` from a calibrate work dir (or its stats file), checked
    against the model (``sizes``: each linear's input size): ValueError naming what does not fit."""
    file = os.path.join(path, STATS_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f'--calib-stats {path}: no {STATS_FILE} there (write it with lmdeploy lite '
                                'calibrate MODEL --work-dir DIR)')
    absmax = torch.load(file, map_location='cpu', weights_only=True).get('absmax', {})
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    for i in range(num_layers):
        out[i] = {}
        for name in names:
            key = f'model.layers.{i}.{name}'
            value = absmax.get(key)
            if value is None:
                raise ValueError(f'--calib-stats {file}: no absmax for {key} (calibrated on another model?)')
            if value.shape != (sizes[name], ):
                raise ValueError(f'--calib-stats {file}: {key} has {tuple(value.shape)} channels, the model '
                                 f'{sizes[name]} (calibrated on another model?)')
            out[i][name] = value
    extra = sum(1 for k in absmax if int(k.split('.')[2]) >= num_layers)
    if extra:
        raise ValueError(f'--calib-stats {file}: statistics for more than the model\'s {num_layers} layers '
                         '(calibrated on another model?)')
    return out


def calibrated_tokens(path: str) -> Optional[int]:
    """The calibration tokens a calibrate work dir's statistics came from (None where its calibration.json is
    missing)."""
    file = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), 'calibration.json')
    try:
        with open(file) as f:
            return int(json.load(f)['calib_tokens'])
    except (OSError, ValueError, KeyError):
        return None
