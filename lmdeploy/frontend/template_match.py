"""Which built-in chat template suits a checkpoint that ships none of its own.

A checkpoint's own template (tokenizer_config.json's ``chat_template`` or chat_template.jinja) always wins; a
``--chat-template NAME`` / ``ChatTemplateConfig`` overrides both. Without either, LMDeploy picks a built-in by
the model's name (``best_match_model``: 'internlm2_5-7b-chat' -> internlm2); this does the same, and falls back
on config.json's ``model_type`` where the family alone fixes the chat format (a renamed InternLM2 directory still
gets InternLM2's turns). Nothing matched: 'base', the prompt as given.

The name is the model directory's, or for a Hugging Face cache snapshot (``models--org--name/snapshots/<hash>``)
the hub id's last part, since the directory itself is then named by a hash.
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

logger = logging.getLogger('lmdeploy')

# (substrings of the lower-cased name, template): the first rule with any substring in the name wins, so the
# more specific names come first (internlm3 before internlm2, qwen2.5 before qwen2 before qwen)
NAME_RULES = (
    (('internlm3', ), 'internlm3'),
    (('internlm2', ), 'internlm2'),  # internlm2-chat-*, internlm2_5-*-chat(-1m)
    (('gemma', ), 'gemma'),
    (('phi-3', 'phi3'), 'phi-3'),  # Phi-3 and Phi-3.5 mini/medium
    (('glm-4', 'glm4'), 'glm4'),
    (('baichuan2', ), 'baichuan2'),
    (('qwen3', ), 'qwen3'),
    (('qwen2.5', 'qwen2_5'), 'qwen2.5'),
    (('qwen2', 'qwen1.5'), 'qwen2'),
    (('qwen', ), 'qwen'),
    (('llama-3', 'llama3', 'llama_3'), 'llama3'),
    (('llama-2', 'llama2', 'llama_2'), 'llama2'),
    (('mistral', 'mixtral'), 'mistral'),
    (('vicuna', ), 'vicuna'),
)

# config.json model_type -> template, only for families whose model type fixes the chat format (not llama,
# qwen2 or mistral, whose one type spans several chat formats and base models)
TYPE_RULES = {
    'internlm2': 'internlm2',
    'internlm3': 'internlm3',
    'gemma': 'gemma',
    'gemma2': 'gemma',
    'gemma3_text': 'gemma',
    'phi3': 'phi-3',
    'glm': 'glm4',
    'glm4': 'glm4',
}


def model_name_of(model_path: str) -> str:
    """The name a path gives its model: the directory's, or a hub snapshot's repository name."""
    path = os.path.normpath(os.fspath(model_path))
    parent, name = os.path.split(path)
    grand, parent_name = os.path.split(parent)
    repo = os.path.basename(grand)
    if parent_name == 'snapshots' and repo.startswith('models--'):
        return repo.split('--')[-1]
    return name


def match_template(model_path: Optional[str] = None, model_type: Optional[str] = None) -> Tuple[str, str]:
    """(template name, why it was picked) for a checkpoint without a chat template of its own."""
    name = model_name_of(model_path).lower() if model_path else ''
    for needles, template in NAME_RULES:
        hit = next((n for n in needles if n in name), None)
        if hit:
            return template, f'the model name {name!r} contains {hit!r}'
    if model_type in TYPE_RULES:
        return TYPE_RULES[model_type], f"config.json's model_type is {model_type!r}"
    return 'base', 'no built-in template matches the model name or model_type (prompts are passed as given)'


def pick_builtin(model_path: Optional[str] = None, model_type: Optional[str] = None) -> str:
    """match_template's name, logged with the reason (and how to choose another)."""
    template, why = match_template(model_path, model_type)
    logger.info('the checkpoint has no chat template: using the built-in %r (%s); --chat-template NAME chooses '
                'another (`lmdeploy list` names them)', template, why)
    return template
