"""lmdeploy: serve large language models fast on any accelerator.

Heavy modules (torch, transformers) load on first use, so ``import
lmdeploy`` stays fast.
"""
from .version import __version__

_LAZY = {
    'pipeline': 'lmdeploy.api',
    'Pipeline': 'lmdeploy.frontend.pipeline',
    'GenerationConfig': 'lmdeploy.messages',
    'PytorchEngineConfig': 'lmdeploy.messages',
    'TurbomindEngineConfig': 'lmdeploy.messages',
    'Response': 'lmdeploy.messages',
    'RequestError': 'lmdeploy.messages',
    'ChatTemplateConfig': 'lmdeploy.frontend.chat_template',
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = ['__version__', *_LAZY]
