"""Loading a checkpoint's tokenizer (transformers' AutoTokenizer): the one place that decides whether the
checkpoint's own tokenizer code may run.

Some checkpoints ship their tokenizer as code (InternLM2/2.5/3's ``tokenization_internlm2.py``, ChatGLM's,
Baichuan's), named by ``auto_map`` in tokenizer_config.json. As LMDeploy does, it runs by default
(``PytorchEngineConfig.trust_remote_code``, ``--no-trust-remote-code`` to refuse); the model itself never runs
checkpoint code here (engine/models, engine/remote_config.py)."""
from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger('lmdeploy')


def remote_tokenizer_code(model_path: str):
    """The module and class tokenizer_config.json's ``auto_map`` names for AutoTokenizer, or None."""
    try:
        with open(os.path.join(model_path, 'tokenizer_config.json')) as f:
            auto_map = json.load(f).get('auto_map') or {}
    except (OSError, ValueError):
        return None
    entry = auto_map.get('AutoTokenizer')
    if isinstance(entry, (list, tuple)):
        entry = next((e for e in reversed(entry) if e), None)  # (slow, fast): the fast one where there is one
    return entry or None


def load_tokenizer(model_path: str, trust_remote_code: bool = True):
    """``AutoTokenizer.from_pretrained(model_path)``; a checkpoint whose tokenizer is code runs it only with
    ``trust_remote_code`` (else a ValueError saying how to allow it)."""
    from transformers import AutoTokenizer
    code = remote_tokenizer_code(model_path)
    if code and not trust_remote_code:
        raise ValueError(f"{model_path!r}: the tokenizer is the checkpoint's own code ({code}); allow it with "
                         f'PytorchEngineConfig(trust_remote_code=True) or --trust-remote-code')
    if code:
        logger.info('%s: running the checkpoint\'s tokenizer code (%s)', model_path, code)
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=bool(code))
