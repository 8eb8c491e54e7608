"""The OpenAPI schema as the served model makes it: ``model`` names the one model served, token ids are
below its vocabulary size.

Why: the schema says exactly what the server accepts (a schema-driven client or fuzzer that follows it
is never refused for a value the schema allowed); these two limits are known only once a model is loaded.
The request models mark the places (``SERVED_MODEL`` / ``TOKEN_ID`` keys); until a model is loaded the
schema is served without them.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Dict

from fastapi import FastAPI

if TYPE_CHECKING:
    from .state import ServerState

SERVED_MODEL = 'x-served-model'  # a schema node whose value must be the served model's name
TOKEN_ID = 'x-token-id'  # a schema node that is a token id
TOKEN_KEY = 'x-token-key'  # a string schema node that is a token id written in decimal (logit_bias's keys)


def decimal_pattern(limit: int) -> str:
    """A regex matching exactly the decimal numbers 0 to ``limit`` (no leading zeros)."""
    top = str(limit)
    alts = ['[0-9]' if len(top) > 1 else f'[0-{top}]']
    alts += [f'[1-9][0-9]{{{k - 1}}}' for k in range(2, len(top))]
    if len(top) > 1:
        for i, digit in enumerate(top):
            low = '1' if i == 0 else '0'
            if int(digit) > int(low):
                rest = len(top) - i - 1
                alts.append(f'{top[:i]}[{low}-{int(digit) - 1}]' + (f'[0-9]{{{rest}}}' if rest else ''))
        alts.append(top)
    return '^(' + '|'.join(alts) + ')$'


def _fill(node: Any, model_name: str, vocab_size: int):
    if isinstance(node, dict):
        if node.get(SERVED_MODEL):
            node['enum'] = [model_name]
        if node.get(TOKEN_ID):
            node['maximum'] = vocab_size - 1
        if node.get(TOKEN_KEY):
            node['pattern'] = decimal_pattern(vocab_size - 1)
        for value in node.values():
            _fill(value, model_name, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _fill(value, model_name, vocab_size)


def install_schema(app: FastAPI, state: ServerState):
    """Serve ``app.openapi()`` with the loaded model's limits filled in (made once per model)."""
    plain = app.openapi
    made: Dict[Any, Dict[str, Any]] = {}

    def openapi() -> Dict[str, Any]:
        gateway = state.gateway
        key = id(gateway) if gateway is not None else None
        if key not in made:
            schema = plain()
            if gateway is not None:
                schema = copy.deepcopy(schema)
                _fill(schema, state.model_name, gateway.engine.model_config.vocab_size)
            made.clear()
            made[key] = schema
        return made[key]

    app.openapi = openapi
