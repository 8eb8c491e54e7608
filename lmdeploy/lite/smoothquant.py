"""SmoothQuant W8A8 (Xiao et al. 2023) for ``lmdeploy lite smooth_quant``: int8 or fp8 (e4m3) weights and
activations.

The decoder runs one layer at a time on the calibration windows (in float; each layer's float outputs are the
next one's inputs), recording the per-input-channel absolute maximum max|X_j| of what each group of linears
reads. Per group, the smoothing factors

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)        (alpha: ``smooth_alpha``, 0.5 by default)

(max|W_j|: over the group's weights' column j) move the activations' outliers into the weights: the group's
weight columns are multiplied by s and the operation producing their input divided by it, so the float model
computes the same function. Groups and what 1/s folds into:

* q/k/v (one input): ``input_layernorm``'s weight;
* gate/up: ``post_attention_layernorm``'s weight;
* down: ``up_proj``'s rows (down reads silu(gate) * up, linear in up's outputs), bias too;
* o: ``v_proj``'s rows (o reads the heads' attention-weighted sums of v, linear in v's outputs). With
  grouped-query attention one row of v feeds the same channel of each of the heads sharing its KV head, so
  those channels get one factor (their activation and weight maxima taken together).

Every decoder linear is then quantized per output channel, symmetrically (int8: scale = max|W_o| / 127 and
round to nearest; fp8: scale = max|W_o| / 448 and a cast to e4m3), and saved as ``weight`` (int8 /
float8_e4m3fn) with ``weight_scale`` (float32 [out]); activations are quantized per token at run time
(:mod:`lmdeploy.devices.w8a8`, which defines the format). Per-channel weight quantization is unaffected by
scaling a linear's rows, so folding 1/s into up's or v's rows costs their own quantization nothing. The
embedding, the final norm and lm_head stay float, as do the norms (with 1/s folded in).

``smooth=False`` skips the smoothing: plain per-channel weight / per-token activation round-to-nearest (the
baseline the smoothing is measured against).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

import lmdeploy.devices.layers  # noqa: F401 (first: it imports devices/w8a8.py, which subclasses its LinearImpl)
from lmdeploy.devices.w8a8 import QUANT_DTYPES, quantize_per_channel

from .common import LINEARS, Prepared, run_layer
from .common import progress as layer_progress

# the linears whose inputs are recorded: one of each group (the others of a group read the same input)
RECORDED = ('self_attn.q_proj', 'self_attn.o_proj', 'mlp.gate_proj', 'mlp.down_proj')
EPS = 1e-5


def smoothing_factors(act_max: torch.Tensor, weights: List[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [in] = max|X_j| ** alpha / max|W_j| ** (1 - alpha), W_j over every weight's column j."""
    w_max = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0).float()
    s = act_max.float().clamp(min=EPS).pow(alpha) / w_max.clamp(min=EPS).pow(1 - alpha)
    return s.clamp(min=EPS)


def _scale_rows(lin: torch.nn.Linear, inv: torch.Tensor):
    lin.weight.data = (lin.weight.data.float() / inv[:, None]).to(lin.weight.dtype)
    if lin.bias is not None:
        lin.bias.data = (lin.bias.data.float() / inv).to(lin.bias.dtype)


def _scale_cols(lins, s: torch.Tensor):
    for lin in lins:
        lin.weight.data = (lin.weight.data.float() * s[None, :]).to(lin.weight.dtype)


def smooth_layer(layer, act_max: Dict[str, torch.Tensor], alpha: float, num_kv_heads: int) -> Dict[str, float]:
    """Fold the smoothing factors of q/k/v, gate/up, down and o into ``layer`` (in place, the float function
    unchanged). Returns each group's largest factor over its smallest (how much it moved)."""
    attn, mlp = layer.self_attn, layer.mlp
    spread = {}

    def record(name, s):
        spread[name] = float(s.max() / s.min())

    for name, norm, lins, key in (('qkv', layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj],
                                   'self_attn.q_proj'),
                                  ('gate_up', layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj],
                                   'mlp.gate_proj')):
        s = smoothing_factors(act_max[key], [lin.weight.data for lin in lins], alpha)
        norm.weight.data = (norm.weight.data.float() / s).to(norm.weight.dtype)
        _scale_cols(lins, s)
        record(name, s)

    s = smoothing_factors(act_max['mlp.down_proj'], [mlp.down_proj.weight.data], alpha)
    _scale_rows(mlp.up_proj, s)
    _scale_cols([mlp.down_proj], s)
    record('down', s)

    # o: channel (head h, d) of its input is row (h // rep, d) of v's output
    v_rows, o_in = attn.v_proj.out_features, attn.o_proj.in_features
    if num_kv_heads and o_in % v_rows == 0 and v_rows % num_kv_heads == 0:
        rep, head_dim = o_in // v_rows, v_rows // num_kv_heads
        a = act_max['self_attn.o_proj'].float().reshape(num_kv_heads, rep, head_dim).amax(dim=1).reshape(-1)
        w = attn.o_proj.weight.data.abs().amax(dim=0).float().reshape(num_kv_heads, rep, head_dim)
        w = w.amax(dim=1).reshape(-1)
        s_v = (a.clamp(min=EPS).pow(alpha) / w.clamp(min=EPS).pow(1 - alpha)).clamp(min=EPS)
        _scale_rows(attn.v_proj, s_v)
        _scale_cols([attn.o_proj], s_v.reshape(num_kv_heads, 1, head_dim).expand(-1, rep, -1).reshape(-1))
        record('o', s_v)
    return spread


def _check_dtype(quant_dtype: str) -> str:
    dtype = QUANT_DTYPES.get(str(quant_dtype).lower())
    if dtype is None:
        raise ValueError(f"--quant-dtype {quant_dtype!r}: 'int8' or 'fp8'")
    return dtype


@torch.no_grad()
def calibrate_and_smooth(model: Optional[str], work_dir: str, calib_dataset: Optional[str] = None,
                         calib_samples: int = 128, calib_seqlen: int = 2048, batch_size: int = 1,
                         smooth_alpha: float = 0.5, smooth: bool = True, device: str = 'auto',
                         progress: bool = True, calib_stats: Optional[str] = None) -> Prepared:
    """The float model loaded and, with ``smooth``, smoothed layer by layer on the calibration text (in place:
    the same function in float). ``prep.spreads``: per layer and group, the factors' max / min.
    ``calib_stats``: a ``lite calibrate`` work dir whose recorded maxima are used instead of running the
    calibration windows (the float model's, as here: smoothing leaves the function unchanged)."""
    if not 0 <= smooth_alpha <= 1:
        raise ValueError(f'--smooth-alpha {smooth_alpha}: between 0 and 1')
    prep = Prepared(model, work_dir, 'smooth_quant', calib_dataset, calib_samples if calib_stats is None else 1,
                    calib_seqlen, batch_size, None, None, device)
    dev, layers, batches = prep.device, prep.layers, prep.batches
    cfg = prep.hf.config
    num_kv_heads = getattr(cfg, 'num_key_value_heads', None) or cfg.num_attention_heads
    recorded = None
    if calib_stats is not None:
        from .calibrate import calibrated_tokens, load_absmax
        sizes = {n: layers[0].get_submodule(n).in_features for n in RECORDED}
        recorded = load_absmax(calib_stats, len(layers), RECORDED, sizes)
        prep.calib_tokens = calibrated_tokens(calib_stats)
    prep.spreads = []
    prep.smooth_alpha = smooth_alpha if smooth else None
    for i in layer_progress(len(layers) if smooth else 0, progress, 'smooth_quant'):
        layer = layers[i].to(dev)
        if recorded is not None:
            prep.spreads.append(smooth_layer(layer, {k: v.to(dev) for k, v in recorded[i].items()}, smooth_alpha,
                                             num_kv_heads))
            layers[i] = layer.to('cpu')
            continue
        act_max: Dict[str, torch.Tensor] = {}

        def hook(name):
            def fn(x):
                m = x.detach().abs().amax(dim=0).float()
                act_max[name] = m if name not in act_max else torch.maximum(act_max[name], m)
            return fn

        outs = run_layer(layer, batches, {n: hook(n) for n in RECORDED}, outputs=i + 1 < len(layers))
        batches = [(o, kw) for o, (_, kw) in zip(outs, batches)]
        prep.spreads.append(smooth_layer(layer, act_max, smooth_alpha, num_kv_heads))
        layers[i] = layer.to('cpu')
    prep.batches = None
    return prep


@torch.no_grad()
def write_quantized(prep: Prepared, work_dir: str, quant_dtype: str = 'int8') -> dict:
    """Quantize every decoder linear of the (smoothed) model per output channel and save ``work_dir``."""
    dtype = _check_dtype(quant_dtype)
    packed: Dict[str, torch.Tensor] = {}
    for i, layer in enumerate(prep.layers):
        for name in LINEARS:
            q, scale = quantize_per_channel(layer.get_submodule(name).weight.data, dtype == 'fp8')
            packed[f'model.layers.{i}.{name}.weight'] = q.cpu()
            packed[f'model.layers.{i}.{name}.weight_scale'] = scale.cpu()
    qconfig = {'quant_method': 'smooth_quant', 'quant_dtype': dtype, 'weight_scheme': 'per_channel_symmetric',
               'activation_scheme': 'per_token_dynamic', 'smooth_alpha': prep.smooth_alpha}
    # Prepared.save writes the model's other tensors (the norms with 1/s folded in) and ``packed`` in place of
    # the decoder linears' float weights (the same names: weight, with weight_scale beside it)
    prep.save(work_dir, packed, qconfig)
    return prep.summary(None, quant_dtype=dtype, smooth_alpha=prep.smooth_alpha, spreads=prep.spreads)


def smooth_quant(model: Optional[str],
                 work_dir: str,
                 quant_dtype: str = 'int8',
                 calib_dataset: Optional[str] = None,
                 calib_samples: int = 128,
                 calib_seqlen: int = 2048,
                 batch_size: int = 1,
                 smooth_alpha: float = 0.5,
                 smooth: bool = True,
                 device: str = 'auto',
                 progress: bool = True,
                 calib_stats: Optional[str] = None) -> dict:
    """Quantize ``model`` (a local Hugging Face directory of a Llama, Mistral, Qwen2 or Qwen3 model) into
    ``work_dir`` as SmoothQuant W8A8 (``quant_dtype`` 'int8' or 'fp8'): see the module's docstring. Returns a
    summary (layers, seconds, calibration tokens, the smoothing factors' spread per layer and group).
    ``calib_stats``: a ``lite calibrate`` work dir to take the activation maxima from (no calibration pass)."""
    _check_dtype(quant_dtype)
    prep = calibrate_and_smooth(model, work_dir, calib_dataset, calib_samples, calib_seqlen, batch_size,
                                smooth_alpha, smooth, device, progress, calib_stats)
    return write_quantized(prep, work_dir, quant_dtype)
