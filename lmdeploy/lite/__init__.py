"""``lmdeploy lite``: offline tools that write quantized checkpoints the engine (and other tools) load.

* :func:`auto_awq` (``lmdeploy lite auto_awq MODEL --work-dir OUT``): AWQ 4-bit weights with a zero point and
  a scale per group of input columns, activation-aware scales searched on calibration text, saved in AutoAWQ's
  GEMM layout (``quant_method: awq``, ``version: gemm``) that :mod:`lmdeploy.devices.quant_formats` loads.

Modules: :mod:`.calib` (calibration text, no network), :mod:`.awq` (the layer-by-layer search and
quantization), :mod:`.pack` (the AWQ GEMM packing and the saved directory). Nothing here is imported by
``import lmdeploy``; this package itself imports neither torch nor transformers until a function runs.
"""
from __future__ import annotations


def auto_awq(*args, **kwargs):
    """See :func:`lmdeploy.lite.awq.auto_awq`."""
    from .awq import auto_awq as run
    return run(*args, **kwargs)


__all__ = ['auto_awq']
