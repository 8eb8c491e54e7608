"""Datasets of the local lm-evaluation-harness tasks in this folder: the JSONL files next to this module,
read wherever lm_eval runs from (no Hugging Face hub, no datasets cache)."""
import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str) -> datasets.DatasetDict:
    with open(os.path.join(HERE, name), encoding='utf-8') as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({'test': datasets.Dataset.from_list(rows)})


def load_mc(**kwargs) -> datasets.DatasetDict:
    """mc.jsonl: {"question", "choices" (4 strings), "answer" (the right choice's index)}."""
    return _load('mc.jsonl')


def load_gen(**kwargs) -> datasets.DatasetDict:
    """gen.jsonl: {"question", "answer" (one word)}."""
    return _load('gen.jsonl')
