"""``pipeline()``: the one-line entry point."""
from __future__ import annotations

import logging
from typing import Optional, Union

from .messages import PytorchEngineConfig, TurbomindEngineConfig

logger = logging.getLogger('lmdeploy')


def pipeline(model_path: Optional[str] = None,
             backend_config: Union[PytorchEngineConfig, TurbomindEngineConfig, None] = None,
             chat_template_config=None,
             log_level: str = 'WARNING',
             model_name: Optional[str] = None,
             **kwargs):
    """Load a model and return a :class:`~lmdeploy.frontend.pipeline.Pipeline`.

    model_path: a local Hugging Face model directory (config.json +
        safetensors); None or 'default' serves the embedded SmolLM2-135M.
    backend_config: PytorchEngineConfig; a TurbomindEngineConfig is mapped
        onto it (this build has one engine).
    """
    from .default_model import resolve_model_path
    from .frontend.pipeline import Pipeline
    logging.getLogger('lmdeploy').setLevel(log_level)
    if isinstance(backend_config, TurbomindEngineConfig):
        logger.warning('TurbomindEngineConfig is mapped onto the PyTorch engine')
        backend_config = backend_config.to_pytorch()
    if kwargs:
        raise TypeError(f'pipeline() got unexpected arguments: {sorted(kwargs)}')
    return Pipeline(resolve_model_path(model_path), backend_config, chat_template_config, model_name)
