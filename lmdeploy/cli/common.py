"""Argument helpers the ``lmdeploy`` subcommands share: the engine flags (:func:`add_engine_args`) and the one
builder of their :class:`PytorchEngineConfig` (:func:`build_engine_config`), the chat template option
(:func:`add_chat_template_arg`, read by :func:`parse_chat_template` / :func:`chat_template_config`), the
parser classes.

Kept free of torch: building the parser (``lmdeploy --help``,
``lmdeploy --version``) must stay fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Dict, Optional

from lmdeploy.devices.registry import device_choices
from lmdeploy.messages import MODEL_FORMATS, GenerationConfig, PytorchEngineConfig

BACKENDS = ('pytorch', 'turbomind')
DTYPES = ('auto', 'float16', 'bfloat16', 'float32')
LOG_LEVELS = ('CRITICAL', 'FATAL', 'ERROR', 'WARN', 'WARNING', 'INFO', 'DEBUG', 'NOTSET')

_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PytorchEngineConfig)}
_GEN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerationConfig)}


class Parser(argparse.ArgumentParser):
    """``lmdeploy``'s parser: flags are taken only when spelled out (argparse's prefix matching would read
    ``--max-new-token`` as ``--max-new-tokens`` and a later flag's name could change what an old command
    line means). Its subcommands' parsers are :class:`Subcommand`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault('allow_abbrev', False)
        super().__init__(*args, **kwargs)

    def add_subparsers(self, **kwargs):
        kwargs.setdefault('parser_class', Subcommand)
        return super().add_subparsers(**kwargs)


class Subcommand(Parser):
    """A subcommand's parser: an argument it does not know is reported with the subcommand's own usage
    (``usage: lmdeploy generate ...``), not the top-level one argparse would show."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f'unrecognized arguments: {" ".join(extras)}')
        return namespace, extras


def add_model_arg(parser: argparse.ArgumentParser):
    parser.add_argument('model_path', nargs='?', default=None, metavar='MODEL',
                        help='local Hugging Face model directory (config.json + *.safetensors); '
                        "omitted or 'default': the embedded SmolLM2-135M-Instruct")


def add_engine_args(parser: argparse.ArgumentParser):
    """Flags that become a :class:`PytorchEngineConfig` (see :func:`build_engine_config`)."""
    d = _ENGINE_DEFAULTS
    g = parser.add_argument_group('engine')
    g.add_argument('--backend', default='pytorch', choices=BACKENDS,
                   help="inference engine; 'turbomind' is accepted and mapped onto the pytorch engine "
                   '(default: %(default)s)')
    g.add_argument('--device', default=d['device_type'], choices=device_choices(),
                   help="device to run on; 'auto' picks the best available (cuda, then ascend, then cpu, among the "
                   'built-in ones) (default: %(default)s)')
    g.add_argument('--dtype', default=d['dtype'], choices=DTYPES,
                   help="weights / activations dtype; 'auto' lets the device choose (default: %(default)s)")
    g.add_argument('--tp', type=int, default=d['tp'],
                   help='tensor parallel size: split the model over this many devices (default: %(default)s)')
    g.add_argument('--distributed-executor-backend', default=None, choices=('mp', 'ray'),
                   help="with --tp > 1, how the other ranks run: 'mp' (processes of this machine, the default) "
                   "or 'ray' (Ray actors, on the machines of a Ray cluster; pip install 'lmdeploy[ray]')")
    g.add_argument('--session-len', type=int, default=d['session_len'],
                   help="most tokens in one session, prompt plus output (default: the model's "
                   'max_position_embeddings)')
    g.add_argument('--max-batch-size', type=int, default=d['max_batch_size'],
                   help='most sequences in one engine step (default: chosen by the engine)')
    g.add_argument('--cache-max-entry-count', type=float, default=d['cache_max_entry_count'],
                   help='fraction of the free device memory the KV cache takes (default: %(default)s)')
    g.add_argument('--cache-block-seq-len', type=int, default=d['block_size'],
                   help='tokens per KV cache block, a power of two (default: %(default)s)')
    g.add_argument('--enable-prefix-caching', action='store_true', help='reuse the KV cache of shared prefixes')
    g.add_argument('--quant-policy', type=int, default=d['quant_policy'], choices=(0, 4, 8),
                   help='KV cache quantization: 0 none, 4 or 8 bits (default: %(default)s)')
    g.add_argument('--max-prefill-token-num', type=int, default=d['max_prefill_token_num'],
                   help='most prompt tokens prefilled in one step (default: %(default)s)')
    g.add_argument('--eager-mode', action='store_true', help='disable graph capture (CUDA graphs)')
    g.add_argument('--trust-remote-code', action=argparse.BooleanOptionalAction, default=True,
                   help="run a tokenizer the checkpoint ships as code (InternLM2, ChatGLM, Baichuan) "
                   '(default: yes, as LMDeploy)')
    g.add_argument('--model-format', default=None, choices=[f for f in MODEL_FORMATS if f],
                   help="what the checkpoint's weights are, as LMDeploy's flag says it: 'hf' (as config.json "
                   "says), 'awq', 'gptq' or 'smooth_quant'; config.json's quantization_config decides how they "
                   'load, and a checkpoint that says otherwise is refused (default: no claim)')
    g.add_argument('--engine-process', action=argparse.BooleanOptionalAction, default=None,
                   help='run the engine loop in a process of its own (default: yes for the API server, '
                   'no for the other commands)')
    return g


def add_chat_template_arg(parser: argparse.ArgumentParser):
    parser.add_argument('--chat-template', default=None, metavar='NAME_OR_JSON',
                        help="a builtin chat template name (see 'lmdeploy list') or the path of a JSON file "
                        "with ChatTemplateConfig fields; default: the model's own template")


def add_log_args(parser: argparse.ArgumentParser, default: str = 'WARNING'):
    parser.add_argument('--log-level', default=default, choices=LOG_LEVELS,
                        help='log level (default: %(default)s)')


def backend_name(args, out=None) -> str:
    """The engine to use: always 'pytorch'; 'turbomind' is mapped with a notice."""
    if getattr(args, 'backend', 'pytorch') == 'turbomind':
        print("note: --backend turbomind is not available in this build; using the pytorch engine",
              file=out or sys.stderr)
    return 'pytorch'


def build_engine_config(args) -> PytorchEngineConfig:
    """argparse namespace (from :func:`add_engine_args`) -> PytorchEngineConfig: the one config builder of
    every command (and of ``python -m lmdeploy.serve.openai.api_server``, whose ``--num-gpu-blocks`` it reads
    where the namespace has it).

    Invalid values raise ValueError naming the field."""
    return PytorchEngineConfig(dtype=args.dtype,
                               tp=args.tp,
                               session_len=args.session_len,
                               max_batch_size=args.max_batch_size,
                               cache_max_entry_count=args.cache_max_entry_count,
                               block_size=args.cache_block_seq_len,
                               enable_prefix_caching=bool(args.enable_prefix_caching),
                               device_type=args.device,
                               eager_mode=bool(args.eager_mode),
                               quant_policy=args.quant_policy,
                               max_prefill_token_num=args.max_prefill_token_num,
                               num_gpu_blocks=getattr(args, 'num_gpu_blocks', _ENGINE_DEFAULTS['num_gpu_blocks']),
                               engine_process=getattr(args, 'engine_process', None),
                               trust_remote_code=getattr(args, 'trust_remote_code', True),
                               model_format=getattr(args, 'model_format', None),
                               distributed_executor_backend=getattr(args, 'distributed_executor_backend', None))


def parse_chat_template(value: Optional[str]):
    """``--chat-template`` -> ChatTemplateConfig or None.

    A path to an existing file, or a string that looks like a JSON object,
    goes through :meth:`ChatTemplateConfig.from_json`; anything else must be
    a builtin template name (ValueError listing them otherwise)."""
    if value is None or value == '':
        return None
    if value.endswith('.json') and not (os.path.isfile(value) or value.lstrip().startswith('{')):
        raise FileNotFoundError(f'chat template file {value!r} does not exist')
    return chat_template_config(value)


def chat_template_config(value):
    """A builtin template name, or a JSON file / string with ChatTemplateConfig fields -> ChatTemplateConfig;
    what is not a string (None, a ChatTemplateConfig) is returned as it is. The one reading of a chat template
    option: :func:`parse_chat_template` (the flag) and ``api_server.serve(chat_template_config=...)``."""
    if value is None or not isinstance(value, str):
        return value
    from lmdeploy.frontend.chat_template import ChatTemplateConfig
    if os.path.isfile(value) or value.lstrip().startswith('{'):
        return ChatTemplateConfig.from_json(value)
    return ChatTemplateConfig(model_name=value)


def resolve_model(model_path: Optional[str]) -> str:
    from lmdeploy.default_model import resolve_model_path
    return resolve_model_path(model_path)


def gen_defaults() -> Dict[str, Any]:
    return dict(_GEN_DEFAULTS)
