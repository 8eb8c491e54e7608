"""AWQ (activation-aware weight quantization, Lin et al. 2023) for ``lmdeploy lite auto_awq``.

A decoder is processed one layer at a time. The calibration windows' inputs to the first decoder layer are
captured once; each layer then runs on its inputs in float, which records the input of each group of linears
that read the same activations and gives the next layer's inputs (a layer's outputs in float, as AutoAWQ
does). Per group:

* q/k/v after ``input_layernorm`` (the error measured on the attention block's output, as AutoAWQ measures it:
  v's errors reach the output one to one, q's and k's through the softmax; measured on q/k/v's own outputs
  instead, perplexity on SmolLM2-135M was 0.5-2.1 points worse at three calibration sizes),
* o after v, only where v's outputs are o's inputs one to one (no grouped-query attention),
* gate/up after ``post_attention_layernorm`` (the error measured on the whole MLP's output),
* down after up (its error on its own output),

the input channels are scaled by s = mean|x| ** alpha / mean|w'| ** (1 - alpha) (normalised so that
max(s) * min(s) = 1; w' each weight over its group's largest |w|, averaged over the group's output rows:
AutoAWQ's "duo scaling", its default): the group's weights multiplied by s column-wise, their quantized form
divided by s again, and alpha chosen from 0, 0.05, ..., 0.95 as the one whose outputs differ least (mean
squared error) from the float group's on the calibration tokens. alpha = 0 stands for s = 1, plain
round-to-nearest, so the search never does worse than it on that measure. (With mean|x| ** alpha alone, on
SmolLM2-135M at 16 x 128 calibration tokens, perplexity was +14.9 % on the calibration text's held-out tail
and +13.8 % on stdlib docstrings; with the weights' term, +11.0 % and +10.6 %.) The chosen 1/s is folded
into the preceding norm's weight (or the preceding linear's rows), s into the group's weight columns, so the
float model computes the same function. Then each weight group's range may shrink (:func:`clip_search`: per
output row and group, the clipping that quantizes with the least output error; not q/k), and every linear of
the layer is quantized (4-bit, asymmetric, per group of input columns) and packed (:mod:`.pack`).

Without ``search_scale``, alpha is fixed (0.5: what LMDeploy's auto_awq does without ``--search-scale``; 0:
round-to-nearest with no scaling at all).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from .common import LINEARS, Prepared, check_group_size, check_model, run_layer  # noqa: F401 (re-exported)
from .common import progress as layer_progress
from .pack import MAX_Q, awq_tensors, quantization_config, quantize
from .resume import Checkpoint, to_device

N_GRID = 20
CLIP_STEPS = 10
# linears whose weights may be clipped, and the cached input each reads (q and k are not: attention scores
# are sensitive to their outliers, as AutoAWQ also leaves them)
CLIPPED = {'self_attn.v_proj': 'self_attn.q_proj', 'self_attn.o_proj': 'self_attn.o_proj',
           'mlp.gate_proj': 'mlp.gate_proj', 'mlp.up_proj': 'mlp.gate_proj', 'mlp.down_proj': 'mlp.down_proj'}
LOSS_ROWS = 8192  # tokens per chunk of a loss evaluation


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).mean())


def _scaled_fake_quant(w: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """W with its columns multiplied by s, quantized as :func:`.pack.quantize` does, dequantized and divided by s
    again (in place on temporaries: this runs 20 times a linear)."""
    out_f, in_f = w.shape
    g = (w.float() * s).reshape(out_f, in_f // group, group)
    lo = g.amin(dim=2, keepdim=True).clamp_(max=0)
    scale = g.amax(dim=2, keepdim=True).clamp_(min=0).sub_(lo).div_(MAX_Q).clamp_(min=1e-5).half().float()
    zero = lo.div_(scale).neg_().round_().clamp_(0, MAX_Q)
    q = g.div_(scale).round_().add_(zero).clamp_(0, MAX_Q)
    return q.sub_(zero).mul_(scale).reshape(out_f, in_f).div_(s).to(w.dtype)


def _relative_weight_mean(ws: List[torch.Tensor], group: int) -> torch.Tensor:
    """Per input column, |w| over the largest |w| of its (row, group), averaged over the rows of ``ws``."""
    w = torch.cat(ws).float().abs()
    g = w.reshape(-1, group)
    return (g / (g.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape).mean(dim=0)


def clip_search(w: torch.Tensor, x: torch.Tensor, group: int, steps: int = CLIP_STEPS) -> torch.Tensor:
    """W [out, in] with each (row, group)'s range shrunk to r * [min, max], r from 1 down to 0.55, whichever
    quantizes with the least output error on the inputs x [tokens, in] (measured against the unclipped W,
    from each group's Gram matrix of x): outliers clipped where rounding the rest more finely pays."""
    out_f, in_f = w.shape
    n = in_f // group
    wg = w.float().reshape(out_f, n, group)
    xg = x.float().reshape(-1, n, group)
    gram = torch.einsum('tng,tnh->ngh', xg, xg)
    hi, lo = wg.amax(dim=2, keepdim=True), wg.amin(dim=2, keepdim=True)
    best_err = torch.full((out_f, n), float('inf'), device=w.device)
    best = wg
    for i in range(steps):
        r = 1 - i * 0.45 / (steps - 1)
        clipped = torch.maximum(torch.minimum(wg, hi * r), lo * r)
        d = _scaled_fake_quant(clipped.reshape(out_f, in_f), torch.ones(in_f, device=w.device), group)
        d = d.float().reshape(out_f, n, group) - wg
        err = torch.einsum('ong,ngh,onh->on', d, gram, d)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better.unsqueeze(2), clipped, best)
    return best.reshape(out_f, in_f).to(w.dtype)


class _Group:
    """Linears that read one input: ``fcs``, the op that produces that input (``prev``: a norm, or a linear
    whose rows feed it), and how the error is measured (``kind``: 'linear' on the linears' outputs, 'mlp' on
    the MLP's, 'attn' on the attention block's: ``attn`` run on each calibration batch, ``batches`` its
    (input shape, keyword arguments) in x's row order)."""

    def __init__(self, name: str, prev: torch.nn.Module, fcs: List[torch.nn.Module], x: torch.Tensor, kind='linear',
                 mlp=None, attn=None, batches=None):
        self.name, self.prev, self.fcs, self.x, self.kind, self.mlp = name, prev, fcs, x, kind, mlp
        self.attn, self.batches = attn, batches

    def _chunks(self):
        """x in the pieces the error is measured on: whole batches for attention (its tokens attend to one
        another), else LOSS_ROWS rows."""
        if self.kind == 'attn':
            return self.x.split([math.prod(shape[:-1]) for shape, _ in self.batches])
        return self.x.split(LOSS_ROWS)

    def _attention(self, weights: List[torch.Tensor], x: torch.Tensor, i: int) -> torch.Tensor:
        """The attention block's output on batch i (x its rows) with q/k/v's weights set to ``weights``."""
        shape, kwargs = self.batches[i]
        saved = [fc.weight.data for fc in self.fcs]
        try:
            for fc, w in zip(self.fcs, weights):
                fc.weight.data = w
            out = self.attn(hidden_states=x.reshape(shape), **kwargs)
        finally:
            for fc, w in zip(self.fcs, saved):
                fc.weight.data = w
        return out[0] if isinstance(out, tuple) else out

    def forward(self, weights: List[torch.Tensor], x: torch.Tensor, i: int = 0) -> torch.Tensor:
        if self.kind == 'attn':
            return self._attention(weights, x, i)
        if self.kind == 'mlp':
            gate, up = self.fcs
            a = F.linear(x, weights[0], gate.bias)
            b = F.linear(x, weights[1], up.bias)
            return self.mlp.down_proj(self.mlp.act_fn(a) * b)
        return torch.cat([F.linear(x, w, fc.bias) for w, fc in zip(weights, self.fcs)], dim=-1)

    def loss(self, weights: List[torch.Tensor], refs) -> float:
        """Mean squared error of the group's outputs with ``weights`` against the float outputs: for linears, from
        the inputs' Gram matrix X^T X where that is cheaper than the outputs (more tokens than input
        features), else by running them."""
        if refs is None:  # Gram form: |X D^T|^2 = sum((D G) * D), D = W' - W
            total = sum(float(((w - fc.weight.data).float() @ self.gram * (w - fc.weight.data).float()).sum())
                        for w, fc in zip(weights, self.fcs))
            return total / (self.x.shape[0] * sum(fc.out_features for fc in self.fcs))
        total, n = 0.0, 0
        for i, (chunk, ref) in enumerate(zip(self._chunks(), refs)):
            out = self.forward(weights, chunk, i)
            total += float((out.float() - ref.float()).pow(2).sum())
            n += out.numel()
        return total / n

    @torch.no_grad()
    def search(self, group: int, alphas) -> tuple:
        """(best alpha, its scales, {alpha: loss})."""
        x_mean = self.x.abs().float().mean(dim=0)
        ws = [fc.weight.data for fc in self.fcs]
        w_mean = _relative_weight_mean(ws, group).to(x_mean.device)
        if self.kind == 'linear' and self.x.shape[0] > self.x.shape[1]:
            x = self.x.float()
            self.gram, refs = x.t() @ x, None
        else:
            refs = [self.forward(ws, chunk, i) for i, chunk in enumerate(self._chunks())]
        best, losses = None, {}
        for alpha in alphas:
            if alpha == 0:
                s = torch.ones_like(x_mean)
            else:
                s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
                s = s / (s.max() * s.min()).sqrt()
            s = s.to(ws[0].device)
            loss = self.loss([_scaled_fake_quant(w, s, group) for w in ws], refs)
            losses[alpha] = loss
            if best is None or loss < best[1]:
                best = (alpha, loss, s)
        self.gram = None
        return best[0], best[2], losses

    @torch.no_grad()
    def fold(self, s: torch.Tensor):
        """1/s into ``prev`` (a norm's weight, or the last len(s) rows of a linear), s into the fcs' columns."""
        prev = self.prev
        if isinstance(prev, torch.nn.Linear):
            prev.weight.data[-len(s):].div_(s.view(-1, 1).to(prev.weight.dtype))
            if prev.bias is not None:
                prev.bias.data[-len(s):].div_(s.to(prev.bias.dtype))
        else:
            prev.weight.data.div_(s.to(prev.weight.dtype))
            if getattr(prev, 'bias', None) is not None:
                prev.bias.data.div_(s.to(prev.bias.dtype))
        for fc in self.fcs:
            fc.weight.data.mul_(s.view(1, -1).to(fc.weight.dtype))


def _groups(layer, inputs: Dict[str, torch.Tensor], batches) -> List[_Group]:
    """``batches``: (input shape, keyword arguments) of each calibration batch the layer ran on."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [_Group('qkv', layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], inputs['self_attn.q_proj'],
                     kind='attn', attn=attn, batches=batches)]
    if attn.v_proj.out_features == attn.o_proj.in_features:
        groups.append(_Group('o', attn.v_proj, [attn.o_proj], inputs['self_attn.o_proj']))
    groups.append(_Group('gate_up', layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj],
                         inputs['mlp.gate_proj'], kind='mlp', mlp=mlp))
    groups.append(_Group('down', mlp.up_proj, [mlp.down_proj], inputs['mlp.down_proj']))
    return groups


@torch.no_grad()
def auto_awq(model: Optional[str],
             work_dir: str,
             calib_dataset: Optional[str] = None,
             calib_samples: int = 128,
             calib_seqlen: int = 2048,
             batch_size: int = 1,
             w_bits: int = 4,
             w_group_size: int = 128,
             search_scale: bool = True,
             ratio: float = 0.5,
             device: str = 'auto',
             progress: bool = True,
             n_grid: int = N_GRID,
             clip: bool = True,
             resume: bool = True) -> dict:
    """Quantize ``model`` (a local Hugging Face directory of a Llama, Mistral, Qwen2 or Qwen3 model) into
    ``work_dir``: AWQ 4-bit weights in AutoAWQ's GEMM layout. Returns a summary: the layers' chosen alphas per
    group and the seconds taken. ``n_grid``: alphas tried, 0, 1 / n_grid, ... (AWQ's 20; tests use fewer).
    ``resume``: go on from an interrupted run with the same arguments (:mod:`.resume`)."""
    prep = Prepared(model, work_dir, 'auto_awq', calib_dataset, calib_samples, calib_seqlen, batch_size, w_bits,
                    w_group_size, device)
    dev, layers, batches = prep.device, prep.layers, prep.batches
    # (scaling: the rule's name, so that layers kept by a run under another rule are not resumed)
    ckpt = Checkpoint(work_dir, dict(prep.key(), w_bits=w_bits, w_group_size=w_group_size, search_scale=search_scale,
                                     ratio=ratio, n_grid=n_grid, clip=clip, scaling='duo', qkv_loss='attention'), resume)
    start, restored, packed, chosen = ckpt.restore(layers)
    if start:
        batches = to_device(restored, dev)
    if search_scale:
        alphas = [i / n_grid for i in range(n_grid)]
    else:
        alphas = [float(ratio)]
    rtn = alphas == [0.0]  # no scaling: nothing to measure
    for i in layer_progress(len(layers), progress, 'auto_awq'):
        if i < start:  # done by an earlier run
            continue
        layer = layers[i].to(dev)
        inputs: Dict[str, List[torch.Tensor]] = {n: [] for n in ('self_attn.q_proj', 'self_attn.o_proj',
                                                                 'mlp.gate_proj', 'mlp.down_proj')}
        if rtn:
            batches = []  # no layer needs inputs
        outs = run_layer(layer, batches, {n: v.append for n, v in inputs.items()})
        attn_batches = [(hidden.shape, kw) for hidden, kw in batches]  # (what the q/k/v group's error reruns)
        batches = [(o, kw) for o, (_, kw) in zip(outs, batches)]
        xs = {n: torch.cat(v) for n, v in inputs.items() if v}
        inputs.clear()

        picked = {}
        for grp in ([] if rtn else _groups(layer, xs, attn_batches)):
            alpha, s, _ = grp.search(w_group_size, alphas)
            if alpha != 0:
                grp.fold(s)
                key = {'qkv': 'self_attn.q_proj', 'o': 'self_attn.o_proj', 'gate_up': 'mlp.gate_proj',
                       'down': 'mlp.down_proj'}[grp.name]
                xs[key] = xs[key] / s  # what the folded layer's linears read now
            picked[grp.name] = alpha
        chosen.append(picked)
        if clip and not rtn:
            for name, key in CLIPPED.items():
                lin = layer.get_submodule(name)
                lin.weight.data = clip_search(lin.weight.data, xs[key], w_group_size)
        del xs

        prefix = f'model.layers.{i}.'
        mine = {}
        for name in LINEARS:
            lin = layer.get_submodule(name)
            q, z, s = quantize(lin.weight.data.float(), w_group_size)
            for key, t in awq_tensors(q.cpu(), z.cpu(), s.cpu()).items():
                mine[f'{prefix}{name}.{key}'] = t
            lin.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # its float copy is done
        packed.update(mine)
        layers[i] = layer.to('cpu')
        ckpt.save(i, layers[i], mine, picked, batches, last=i + 1 == len(layers))

    prep.save(work_dir, packed, quantization_config(w_group_size))
    ckpt.done()
    return prep.summary(w_group_size, alphas=chosen)
