"""``lmdeploy lite``: offline tools that write quantized checkpoints the engine (and other tools) load.

* :func:`auto_awq` (``lmdeploy lite auto_awq MODEL --work-dir OUT``): AWQ 4-bit weights with a zero point and
  a scale per group of input columns, activation-aware scales searched on calibration text, saved in AutoAWQ's
  GEMM layout (``quant_method: awq``, ``version: gemm``) that :mod:`lmdeploy.devices.quant_formats` loads.
* :func:`auto_gptq` (``lmdeploy lite auto_gptq MODEL --work-dir OUT``): GPTQ 4-bit weights (column by column
  with the rounding error carried onto the columns still to come, under the calibration inputs' Hessian),
  asymmetric or ``sym``, optionally in act-order (``desc_act``), saved in GPTQ's checkpoint format "gptq"
  (``quant_method: gptq``) as AutoGPTQ / GPTQModel write it.

* :func:`smooth_quant` (``lmdeploy lite smooth_quant MODEL --work-dir OUT --quant-dtype int8|fp8``): SmoothQuant
  W8A8, smoothing factors folded into the norms / preceding linears, int8 or fp8 weights per channel
  (``quant_method: smooth_quant``, :mod:`lmdeploy.devices.w8a8`).

* :func:`calibrate` (``lmdeploy lite calibrate MODEL --work-dir OUT``): per-channel statistics of what every
  decoder linear reads on the calibration text (``inputs_stats.pt``), which ``smooth_quant --calib-stats``
  reuses.

Modules: :mod:`.calib` (calibration text, no network), :mod:`.common` (what both share: loading, calibration
inputs, running a layer, saving), :mod:`.awq` (the layer-by-layer search and quantization), :mod:`.gptq`
(GPTQ), :mod:`.smoothquant` (SmoothQuant W8A8), :mod:`.calibrate` (the statistics), :mod:`.pack` (group quantization, the AWQ GEMM and GPTQ
packings and the saved directory). Nothing here is imported by ``import lmdeploy``; this package itself
imports neither torch nor transformers until a function runs.
"""
from __future__ import annotations


def auto_awq(*args, **kwargs):
    """See :func:`lmdeploy.lite.awq.auto_awq`."""
    from .awq import auto_awq as run
    return run(*args, **kwargs)


def auto_gptq(*args, **kwargs):
    """See :func:`lmdeploy.lite.gptq.auto_gptq`."""
    from .gptq import auto_gptq as run
    return run(*args, **kwargs)


def smooth_quant(*args, **kwargs):
    """See :func:`lmdeploy.lite.smoothquant.smooth_quant`."""
    from .smoothquant import smooth_quant as run
    return run(*args, **kwargs)


def calibrate(*args, **kwargs):
    """See :func:`lmdeploy.lite.calibrate.calibrate`."""
    from .calibrate import calibrate as run
    return run(*args, **kwargs)


__all__ = ['auto_awq', 'auto_gptq', 'smooth_quant', 'calibrate']
