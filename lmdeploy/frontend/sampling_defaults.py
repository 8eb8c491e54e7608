"""What the model's own ``generation_config.json`` says to sample with: the defaults of a request that is
silent about temperature, top_p, top_k, min_p or repetition_penalty (as vLLM reads that file).

Why: a model is tuned for its own settings, and a server that samples at OpenAI's temperature 1 where the
model's authors chose otherwise (or chose greedy decoding) answers worse than the same model elsewhere.

The file is read as its writers meant it: ``do_sample: true`` samples (at its ``temperature``, 1.0 if it
gives none), ``do_sample: false`` decodes greedily, and a file without ``do_sample`` samples at the
``temperature`` it gives, else decodes greedily (transformers' default). A filter the file does not name is
off (top_p 1, top_k 0, min_p 0, repetition_penalty 1). A value out of range is ignored, with a warning.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Dict

logger = logging.getLogger('lmdeploy')


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# field -> (what a valid value is, in words; the check)
_VALID = {
    'temperature': ('a number >= 0', lambda x: _number(x) and x >= 0),
    'top_p': ('a number in (0, 1]', lambda x: _number(x) and 0 < x <= 1),
    'top_k': ('an integer >= 0', lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0),
    'min_p': ('a number in [0, 1]', lambda x: _number(x) and 0 <= x <= 1),
    'repetition_penalty': ('a number > 0', lambda x: _number(x) and x > 0),
}


def sampling_defaults(config: Dict[str, Any], where: str = 'generation_config.json') -> SamplingDefaults:
    """The defaults a generation config (the file's JSON object) gives; see the module docstring."""
    given = {}
    for name, (words, ok) in _VALID.items():
        value = config.get(name)
        if value is None:
            continue
        if ok(value):
            given[name] = value
        else:
            logger.warning('%s: %s must be %s, got %r; ignored', where, name, words, value)
    do_sample = config.get('do_sample')
    if do_sample is True:
        temperature = given.get('temperature', 1.0)
    elif do_sample is None:
        temperature = given.get('temperature', 0.0)
    else:
        temperature = 0.0
    return SamplingDefaults(temperature=float(temperature), top_p=float(given.get('top_p', 1.0)),
                            top_k=int(given.get('top_k', 0)), min_p=float(given.get('min_p', 0.0)),
                            repetition_penalty=float(given.get('repetition_penalty', 1.0)))


def load_sampling_defaults(model_path: str) -> SamplingDefaults:
    """The defaults of the model directory's ``generation_config.json`` (greedy, no filters, if it has none
    or it cannot be read)."""
    path = os.path.join(model_path, 'generation_config.json')
    if not os.path.isfile(path):
        return SamplingDefaults()
    try:
        with open(path, encoding='utf-8') as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        logger.warning('%s cannot be read (%s): sampling defaults are greedy decoding', path, e)
        return SamplingDefaults()
    if not isinstance(config, dict):
        logger.warning('%s does not hold a JSON object: sampling defaults are greedy decoding', path)
        return SamplingDefaults()
    return sampling_defaults(config, path)
