"""The 'lmdeploy' logger's set-up, for the processes that own their output (the server, the engine process)."""
from __future__ import annotations

import logging


def configure(level, tag: str = '') -> logging.Logger:
    """Set the 'lmdeploy' logger's level and, when nothing handles logs yet, print them to stderr
    (``tag``: what the lines name after the logger, e.g. the engine process)."""
    log = logging.getLogger('lmdeploy')
    log.setLevel(level)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f'%(asctime)s %(levelname)s %(name)s{tag}: %(message)s'))
        log.addHandler(handler)
    return log
