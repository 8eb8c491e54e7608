"""Calibration text for ``lmdeploy lite``, with no network.

The default is the text of ``pydoc_data.topics`` (Python's own language reference topics, which ship with
every CPython: about 113,000 SmolLM2 tokens), its topics in sorted order. ``--calib-dataset PATH`` takes a
local file instead: ``.txt`` (the whole file is one text) or ``.jsonl`` (one JSON object a line, its "text"
field; the texts joined by blank lines).

The text is tokenized once and cut into consecutive windows of ``seqlen`` tokens from its start; where it
holds fewer than ``samples`` windows, another pass begins ``seqlen // 2 + 1`` tokens further on (so no window
repeats). Calibration thus reads the text from its start: 8 windows of 128 tokens read its first 1,024 tokens
only, and a test can hold out the rest.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

DEFAULT_DATASET = 'pydoc_data.topics'


def default_text() -> str:
    import pydoc_data.topics as topics
    return '\n\n'.join(topics.topics[k] for k in sorted(topics.topics))


def read_text(path: Optional[str]) -> str:
    """The calibration text of ``--calib-dataset`` (None or 'pydoc': the default)."""
    if path in (None, '', 'pydoc', DEFAULT_DATASET):
        return default_text()
    if not os.path.isfile(path):
        raise FileNotFoundError(f'--calib-dataset: {path!r} is not a file (give a local .txt or .jsonl file; '
                                'omitted, the text of pydoc_data.topics that ships with Python is used)')
    with open(path, encoding='utf-8') as f:
        if not path.endswith('.jsonl'):
            text = f.read()
        else:
            texts = []
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f'--calib-dataset {path}: line {n} is not JSON ({e})') from None
                if not isinstance(row, dict) or not isinstance(row.get('text'), str):
                    raise ValueError(f'--calib-dataset {path}: line {n} has no string "text" field')
                texts.append(row['text'])
            text = '\n\n'.join(texts)
    if not text.strip():
        raise ValueError(f'--calib-dataset {path}: no text')
    return text


def windows(ids: List[int], samples: int, seqlen: int) -> List[List[int]]:
    """``samples`` windows of ``seqlen`` tokens of ``ids``: consecutive from the start; while more are needed,
    another pass over the text starting ``seqlen // 2 + 1`` tokens further on (modulo a window, so no pass
    repeats another's windows)."""
    if samples < 1 or seqlen < 1:
        raise ValueError(f'calibration needs samples >= 1 and seqlen >= 1 (got {samples}, {seqlen})')
    if len(ids) < seqlen:
        raise ValueError(f'the calibration text has {len(ids)} tokens, fewer than --calib-seqlen {seqlen}')
    out: List[List[int]] = []
    step, p = seqlen // 2 + 1, 0
    while len(out) < samples:
        start = (p * step) % seqlen
        out.extend(ids[i:i + seqlen] for i in range(start, len(ids) - seqlen + 1, seqlen))
        p += 1
    return out[:samples]


def calib_tokens(tokenizer, dataset: Optional[str], samples: int, seqlen: int):
    """LongTensor [samples, seqlen] of calibration token ids."""
    import torch
    ids = tokenizer.encode(read_text(dataset), add_special_tokens=False)
    return torch.tensor(windows(ids, samples, seqlen), dtype=torch.long)
