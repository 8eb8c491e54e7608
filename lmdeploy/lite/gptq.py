"""GPTQ (Frantar et al. 2022, "Accurate post-training quantization for generative pre-trained transformers")
for ``lmdeploy lite auto_gptq``.

For a linear y = x W^T, the output error over the calibration inputs X (rows: tokens) of a changed W' is
tr((W' - W) H (W' - W)^T) / 2 with H = 2 X^T X / tokens (the Hessian of the squared error), the same H for
every output row. GPTQ quantizes the input columns one at a time and, after each, moves the rounding error
onto the columns not yet quantized as the optimal correction under H does: with U the upper Cholesky factor
of H^-1, column j's error e = (w_j - q_j) / U[j, j] is subtracted times U[j, j+1:] from the later columns.
Columns go in blocks of 128 (the correction within a block at once per column, to the columns after the
block as one matrix product when the block is done), H is dampened by 1 % of its mean diagonal
(``damp_percent``) so that it is invertible, and a column never read by the calibration text (H[j, j] = 0)
is set to zero. A group's scale and zero point (:func:`.pack.group_params`: asymmetric with a zero point, or
``sym``) are taken from its columns as they stand when its first column comes up, i.e. with the corrections
of the columns before it. With ``desc_act`` (act-order) the columns go in order of decreasing H[j, j] (the
most-read inputs first), groups are consecutive in that order, and ``g_idx`` gives each input column its group.

A decoder is processed one layer at a time, in the order its linears read their inputs ("true sequential",
as AutoGPTQ): q/k/v (one H: they read the same input, and quantize as one stacked matrix, which is the same
thing since GPTQ treats output rows independently, and gives them one column order with ``desc_act``), then
o on the inputs the quantized q/k/v give, then gate/up, then down; the layer's outputs with all its linears
quantized are the next layer's inputs.

Each calibration window's first token counts ``first_token_weight`` times in H (its rows of X scaled by the
weight's square root), by default a 32nd of the window (``FIRST_TOKEN_SHARE``; 64 at 2,048 tokens). Models
give their first token massive activations (SmolLM2-135M: a down_proj input of norm 2,373 against ~47 for the
others, 83 % of that layer's X^T X in a 512-token window), and every later token attends to it, so its
output errors cost far more than one token's. Counted once, GPTQ traded them for the other tokens': on
SmolLM2-135M (group 64, 16 windows) perplexity rose with the window, +13 % at 128 tokens, +26 % at 512 and
+33 % at 2,048 (the default), on the calibration text's held-out tail and on another text (stdlib
docstrings) alike. Weighted, the best weight on both texts grew with the window (4 at 128, 16 at 512, 64 at
2,048, against 1, 4, 16, 64 and 256 tried): +9 to +12 % at each length (benchmark/RESULTS.md).

Written to the checkpoint format "gptq" (:func:`.pack.gptq_tensors`), where zero points are stored minus one:
asymmetric zero points are kept at 1 or more (:func:`.pack.group_params` with ``min_zero=1``).
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Dict, List, Optional, Tuple

import torch

from .common import Captured, Prepared, run_layer
from .common import progress as layer_progress
from .pack import MAX_Q, group_params, gptq_tensors
from .resume import Checkpoint, to_device

BLOCK = 128
DAMP_PERCENT = 0.01
FIRST_TOKEN_SHARE = 1 / 32  # of a calibration window: the first token's default weight in H
# linears quantized together (they read one input, which the first one's pre-hook records), in order
STAGES = (('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj'), ('self_attn.o_proj', ),
          ('mlp.gate_proj', 'mlp.up_proj'), ('mlp.down_proj', ))


class Hessian:
    """H = 2 X^T X / tokens, accumulated in float32 over batches of inputs X [tokens, in]: whole windows of
    ``window`` tokens, whose first rows count ``first_weight`` times."""

    def __init__(self, n: int, device, window: int = 0, first_weight: float = 1.0):
        self.sum = torch.zeros(n, n, dtype=torch.float32, device=device)
        self.tokens = 0
        self.window, self.first_weight = window, first_weight

    def add(self, x: torch.Tensor):
        weigh = self.first_weight != 1 and bool(self.window)
        x = x.to(torch.float32, copy=weigh)  # (one copy, scaled in place, where the first rows are weighted)
        if weigh:
            x.view(-1, self.window, x.shape[-1])[:, 0].mul_(self.first_weight**0.5)
        self.sum.addmm_(x.t(), x)
        self.tokens += x.shape[0]

    def value(self) -> torch.Tensor:
        return self.sum * (2 / max(self.tokens, 1))


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1 (U^T U = that inverse); the dampening is
    raised tenfold, up to four times, where H is still not positive definite."""
    mean_diag = float(h.diagonal().mean())
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for attempt in range(5):
        hd = h + eye * (damp * 10 ** attempt * mean_diag)
        lower, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            inv = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0:
                return upper
    raise ValueError('GPTQ: the Hessian of the calibration inputs is not positive definite even dampened by '
                     f'{damp * 1e4:g} x its mean diagonal (too few calibration tokens?)')


@contextlib.contextmanager
def one_thread(device: torch.device):
    """On the cpu, torch at one thread: the column loop is thousands of tiny ops, which intra-op threads only
    slow down (100x measured on a busy 2-core machine, where each op waits for both threads to be scheduled);
    tests/test_lite_gptq.py runs its quantizer passes and transformers reference under it too."""
    if device.type != 'cpu':
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group: int, sym: bool = False, desc_act: bool = False,
                  damp: float = DAMP_PERCENT, block: int = BLOCK) -> Tuple[torch.Tensor, ...]:
    """GPTQ of W [out, in] under H [in, in] (see the module's docstring); ``group`` -1: one group a row.
    Returns q uint8 [out, in] (0..15), zeros uint8 [out, groups], scales float16 [out, groups], g_idx int32
    [in] (the group of each input column), the dequantized W' [out, in] in float32 (W' = (q - z[g_idx]) *
    s[g_idx]) and GPTQ's loss: the sum over columns and rows of (w_j - q_j)^2 / (2 U[j, j]^2), the increase
    of tr((W' - W) H (W' - W)^T) / 2 that each step's correction leaves."""
    out_f, in_f = w.shape
    group = in_f if group == -1 else group
    if in_f % group:
        raise ValueError(f'input size {in_f} is not a multiple of the group size {group}')
    with one_thread(w.device):
        return _gptq(w, h, group, sym, desc_act, damp, block)


def _gptq(w, h, group: int, sym: bool, desc_act: bool, damp: float, block: int):
    out_f, in_f = w.shape
    Wt = w.float().t().contiguous()  # [in, out]: a column of W is a contiguous row here
    H = h.float().clone()
    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1
    Wt[dead] = 0
    perm = None
    if desc_act:
        perm = torch.argsort(H.diagonal(), descending=True)
        Wt, H = Wt[perm], H[perm][:, perm]
    U = _inverse_cholesky(H, damp)
    del H
    n_groups = in_f // group
    scales = torch.empty(n_groups, out_f, dtype=torch.float16, device=Wt.device)
    zeros = torch.empty(n_groups, out_f, dtype=torch.float32, device=Wt.device)
    loss = _columns(Wt, U, scales, zeros, group, sym, 0 if sym else 1, block)
    # Wt holds the dequantized weights now, (q - z) * s to rounding: q recovered exactly
    g_idx = torch.arange(in_f, device=Wt.device) // group
    s_rows, z_rows = scales.float()[g_idx], zeros[g_idx]
    q = (Wt / s_rows).round_().add_(z_rows).clamp_(0, MAX_Q)
    if perm is not None:
        inv = torch.argsort(perm)
        q, g_idx, s_rows, z_rows = q[inv], g_idx[inv], s_rows[inv], z_rows[inv]
    deq = ((q - z_rows) * s_rows).t().contiguous()
    return (q.t().to(torch.uint8).contiguous(), zeros.t().to(torch.uint8).contiguous(), scales.t().contiguous(),
            g_idx.to(torch.int32), deq, loss)


def _columns(Wt, U, scales, zeros, group: int, sym: bool, min_zero: int, block: int):
    """The column loop of :func:`gptq_quantize` on W transposed (Wt [in, out], so that a column is a row):
    each row is replaced by its dequantized value and its error carried onto the rows after it; scales /
    zeros [groups, out] filled."""
    in_f = Wt.shape[0]
    diag = U.diagonal().tolist()
    s = z = None
    loss = 0.0
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        Wb = Wt[b0:b1]  # a view: the corrections below land in Wt
        Ub = U[b0:b1, b0:b1]
        err = torch.empty(b1 - b0, Wt.shape[1], device=Wt.device)
        for i in range(b1 - b0):
            j = b0 + i
            if j % group == 0:  # the group's range as its columns stand now (earlier corrections included)
                sg, zg = group_params(Wt[j:j + group].t(), sym, min_zero)
                scales[j // group], zeros[j // group] = sg, zg
                s, z = sg.float(), zg
            row = Wb[i]
            deq = torch.div(row, s).round_().add_(z).clamp_(0, MAX_Q).sub_(z).mul_(s)
            e = torch.sub(row, deq, out=err[i]).div_(diag[j])
            Wb[i:].addr_(Ub[i, i:], e, alpha=-1)  # row i becomes deq
        loss += float(err.pow(2).sum()) / 2
        if b1 < in_f:
            Wt[b1:].addmm_(U[b0:b1, b1:].t(), err, alpha=-1)
    return loss


def _inputs_of(layer, batches, name: str) -> List[torch.Tensor]:
    """What ``layer``'s submodule ``name`` reads, per batch (2-D), the layer run only that far."""
    got = []

    def record(x):
        got.append(x)
        raise Captured

    run_layer(layer, batches, {name: record}, outputs=False)
    return got


def _quantize_layer(layer, batches, quantize) -> List[torch.Tensor]:
    """Quantize a (Llama-shaped) decoder layer's linears in the order they read their inputs, each on the
    inputs the already quantized ones give (``quantize(names, inputs)``), and return the layer's outputs.
    q/k/v and o see the layer run up to them (attention); the rest is computed here from o's input, as the
    layer computes it: h = hidden + o(a), x = post_attention_layernorm(h), y = act(gate(x)) * up(x),
    out = h + down(y) (checked against the layer itself on the first batch)."""
    attn, mlp = layer.self_attn, layer.mlp
    quantize(STAGES[0], _inputs_of(layer, batches, STAGES[0][0]))
    o_in = _inputs_of(layer, batches, STAGES[1][0])
    quantize(STAGES[1], o_in)
    mids = [hidden.reshape(-1, hidden.shape[-1]) + attn.o_proj(a) for a, (hidden, _) in zip(o_in, batches)]
    del o_in
    xs = [layer.post_attention_layernorm(h) for h in mids]
    quantize(STAGES[2], xs)
    del xs

    def ys():
        for h in mids:
            x = layer.post_attention_layernorm(h)
            yield mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)

    quantize(STAGES[3], ys())
    outs = [(h + mlp.down_proj(y)).reshape(hidden.shape) for h, y, (hidden, _) in zip(mids, ys(), batches)]
    if batches:
        hidden, kwargs = batches[0]
        ref = layer(hidden, **kwargs)
        ref = ref[0] if isinstance(ref, tuple) else ref
        if not torch.allclose(ref, outs[0], rtol=1e-3, atol=1e-3 * float(ref.abs().max())):
            raise RuntimeError('auto_gptq: this decoder layer does not compute h = hidden + o(attn), out = h + '
                               "mlp(post_attention_layernorm(h)) as Llama's does; it is not supported")
    return outs


def quantization_config(group: int, sym: bool, desc_act: bool, damp: float = DAMP_PERCENT) -> dict:
    """``quantization_config`` as AutoGPTQ / optimum write it (quantize_config.json holds the same)."""
    return {'quant_method': 'gptq', 'bits': 4, 'group_size': group, 'desc_act': desc_act, 'sym': sym,
            'damp_percent': damp, 'true_sequential': True, 'static_groups': False, 'checkpoint_format': 'gptq',
            'model_file_base_name': 'model'}


@torch.no_grad()
def auto_gptq(model: Optional[str],
              work_dir: str,
              calib_dataset: Optional[str] = None,
              calib_samples: int = 128,
              calib_seqlen: int = 2048,
              batch_size: int = 1,
              w_bits: int = 4,
              w_group_size: int = 128,
              sym: bool = False,
              desc_act: bool = False,
              damp_percent: float = DAMP_PERCENT,
              device: str = 'auto',
              progress: bool = True,
              resume: bool = True,
              first_token_weight: Optional[float] = None) -> dict:
    """Quantize ``model`` (a local Hugging Face directory of a Llama, Mistral, Qwen2 or Qwen3 model) into
    ``work_dir``: GPTQ 4-bit weights in the checkpoint format "gptq" (``quant_method: gptq``). Returns a
    summary: per layer, each stage's output error relative to the float stage's on the calibration inputs,
    and the seconds taken. ``resume``: go on from an interrupted run with the same arguments (:mod:`.resume`).
    ``first_token_weight``: how many tokens each window's first one counts as in H (module docstring); None:
    ``calib_seqlen * FIRST_TOKEN_SHARE``, at least 1."""
    if not 0 <= damp_percent < 1:
        raise ValueError(f'damp_percent {damp_percent}: a fraction of the mean diagonal, 0 <= it < 1')
    if first_token_weight is None:
        first_token_weight = max(1.0, calib_seqlen * FIRST_TOKEN_SHARE)
    if not first_token_weight > 0:
        raise ValueError(f'first_token_weight {first_token_weight}: a positive number of tokens')
    prep = Prepared(model, work_dir, 'auto_gptq', calib_dataset, calib_samples, calib_seqlen, batch_size, w_bits,
                    w_group_size, device, rows_packed=True)
    dev, layers, batches = prep.device, prep.layers, prep.batches
    ckpt = Checkpoint(work_dir, dict(prep.key(), w_bits=w_bits, w_group_size=w_group_size, sym=sym,
                                     desc_act=desc_act, damp_percent=damp_percent,
                                     first_token_weight=first_token_weight), resume)
    start, restored, packed, losses = ckpt.restore(layers)
    if start:
        batches = to_device(restored, dev)
    for i in layer_progress(len(layers), progress, 'auto_gptq'):
        if i < start:  # done by an earlier run
            continue
        layer = layers[i].to(dev)
        prefix = f'model.layers.{i}.'
        loss: Dict[str, float] = {}

        def quantize(names, inputs):
            """GPTQ of the linears ``names`` (one input) on ``inputs`` (an iterable of 2-D batches); their
            weights become the dequantized ones, which the later stages and layers read."""
            lins = [layer.get_submodule(n) for n in names]
            hess = Hessian(lins[0].in_features, dev, calib_seqlen, first_token_weight)
            for x in inputs:
                hess.add(x)
            w = torch.cat([lin.weight.data for lin in lins])
            q, z, s, g_idx, deq, loss[names[0].split('.')[-1]] = gptq_quantize(w, hess.value(), w_group_size, sym,
                                                                               desc_act, damp_percent)
            row = 0
            for name, lin in zip(names, lins):
                rows = slice(row, row + lin.out_features)
                row += lin.out_features
                for key, t in gptq_tensors(q[rows].cpu(), z[rows].cpu(), s[rows].cpu(), g_idx.cpu()).items():
                    packed[f'{prefix}{name}.{key}'] = t
                lin.weight.data = deq[rows].to(lin.weight.dtype)

        outs = _quantize_layer(layer, batches, quantize)
        losses.append(loss)
        batches = [(o, kw) for o, (_, kw) in zip(outs, batches)]
        for name in (n for names in STAGES for n in names):
            layer.get_submodule(name).weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        layers[i] = layer.to('cpu')
        ckpt.save(i, layers[i], {k: v for k, v in packed.items() if k.startswith(prefix)}, loss, batches,
                  last=i + 1 == len(layers))
    qconfig = quantization_config(w_group_size, sym, desc_act, damp_percent)
    prep.save(work_dir, packed, qconfig)
    with open(os.path.join(work_dir, 'quantize_config.json'), 'w') as f:  # where AutoGPTQ / GPTQModel look
        json.dump(qconfig, f, indent=2)
    ckpt.done()
    return prep.summary(w_group_size, losses=losses, desc_act=desc_act, sym=sym,
                        first_token_weight=first_token_weight)
