"""Public configuration and result types.

Kept free of torch at import time so that ``import lmdeploy`` stays fast.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Literal, Optional

# A logits processor gets the ids generated so far (1-D LongTensor) and the
# next-token scores (1-D FloatTensor) and returns the new scores.
LogitsProcessor = Callable[[Any, Any], Any]


MAX_N = 64  # samples per prompt (GenerationConfig.n)
# A temperature below this decodes greedily: the sampler divides float32 logits by it, and a smaller one
# overflows them (1e-46 is 0 in float32: NaN logits) while the draw is already the argmax's pick.
GREEDY_TEMPERATURE = 1e-5
# A repetition penalty scales float32 logits by it (or its inverse): beyond these bounds they would
# overflow, so a stronger penalty is applied as the bound (the tokens' order is the same).
REPETITION_PENALTY_BOUNDS = (1e-6, 1e6)
LOGIT_BIAS_BOUND = 100.0  # OpenAI's range for a token's bias: [-100, 100]


def _finite(x: Any) -> bool:
    """A real number that is not NaN or infinite (a bool is not a number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(cond: bool, name: str, msg: str):
    if not cond:
        raise ValueError(f'GenerationConfig.{name} {msg}' if '.' not in name else f'{name} {msg}')


@dataclass
class GenerationConfig:
    """How to generate: the fields of LMDeploy's ``GenerationConfig``.

    ``do_sample=False`` (the default), ``top_k=1`` or a ``temperature`` below
    ``GREEDY_TEMPERATURE`` (1e-5; 0 included) decode greedily. ``random_seed``
    makes sampling reproducible regardless of which other requests share the
    batch. ``n`` samples per prompt (the pipeline
    returns a list of n Responses for it; sample i draws with
    ``random_seed + i``).

    ``frequency_penalty`` and ``presence_penalty`` are OpenAI's: each
    generated token's score drops by frequency_penalty times how often it was
    generated so far, plus presence_penalty once it was (both in [-2, 2]; the
    prompt does not count). ``repetition_penalty`` (transformers', over prompt
    and output) applies before them. ``logit_bias`` ({token id: bias in
    [-100, 100]}) is added to the model's scores before any of them.
    ``prompt_logprobs`` (N >= 0): each prompt token's logprob and the top-N
    alternatives at its position, from the prompt's own forward pass (the
    first token has none); with ``max_new_tokens=0`` the prompt is only
    scored.
    """
    n: int = 1
    max_new_tokens: int = 512
    do_sample: bool = False
    top_p: float = 1.0
    top_k: int = 50
    min_p: float = 0.0
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[Dict[int, float]] = None
    ignore_eos: bool = False
    random_seed: Optional[int] = None
    stop_words: Optional[List[str]] = None
    bad_words: Optional[List[str]] = None
    stop_token_ids: Optional[List[int]] = None
    bad_token_ids: Optional[List[int]] = None
    min_new_tokens: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: Optional[int] = None
    response_format: Optional[Dict] = None
    logits_processors: Optional[List[LogitsProcessor]] = None
    output_logits: Optional[Literal['all', 'generation']] = None
    output_last_hidden_state: Optional[Literal['all', 'generation']] = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[int] = None

    def __post_init__(self):
        self.validate()

    def validate(self):
        """Raise ValueError naming the first invalid field."""
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, 'n',
               f'must be an integer in [1, {MAX_N}], got {self.n!r}')
        _check(isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool)
               and self.max_new_tokens >= 0, 'max_new_tokens',
               f'must be an integer >= 0 (0: score the prompt only), got {self.max_new_tokens!r}')
        _check(0.0 < self.top_p <= 1.0, 'top_p', f'must be in (0, 1], got {self.top_p}')
        _check(isinstance(self.top_k, int) and self.top_k >= 0, 'top_k',
               f'must be an integer >= 0 (0 disables it), got {self.top_k!r}')
        _check(0.0 <= self.min_p <= 1.0, 'min_p', f'must be in [0, 1], got {self.min_p}')
        _check(_finite(self.temperature) and self.temperature >= 0.0, 'temperature',
               f'must be a finite number >= 0 (below {GREEDY_TEMPERATURE}: greedy), got {self.temperature!r}')
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0.0, 'repetition_penalty',
               f'must be a finite number > 0 (1: none), got {self.repetition_penalty!r}')
        for name in ('frequency_penalty', 'presence_penalty'):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, name,
                   f'must be a number in [-2, 2] (0: none), got {value!r}')
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), 'logit_bias', 'must be a dict {token id: bias}')
            for token, bias in self.logit_bias.items():
                _check(isinstance(token, int) and not isinstance(token, bool) and token >= 0, 'logit_bias',
                       f'keys must be token ids (integers >= 0), got {token!r}')
                _check(_finite(bias) and abs(bias) <= LOGIT_BIAS_BOUND, 'logit_bias',
                       f'values must be numbers in [-100, 100], got {bias!r} for token {token}')
        if self.random_seed is not None:
            _check(isinstance(self.random_seed, int) and self.random_seed >= 0, 'random_seed',
                   f'must be a non-negative integer, got {self.random_seed!r}')
        if self.min_new_tokens is not None:
            _check(isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0, 'min_new_tokens',
                   f'must be a non-negative integer, got {self.min_new_tokens!r}')
        for name in ('logprobs', 'prompt_logprobs'):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1024, name,
                       f'must be an integer in [0, 1024], got {value!r}')
        for name in ('stop_words', 'bad_words'):
            words = getattr(self, name)
            if words is not None:
                if isinstance(words, str):
                    setattr(self, name, [words])
                    words = [words]
                _check(all(isinstance(w, str) and w for w in words), name, 'must be a list of non-empty strings')
        for name in ('stop_token_ids', 'bad_token_ids'):
            ids = getattr(self, name)
            if ids is not None:
                if isinstance(ids, int):
                    setattr(self, name, [ids])
                    ids = [ids]
                _check(all(isinstance(i, int) and i >= 0 for i in ids), name,
                       'must be a list of non-negative integers')
        for name in ('output_logits', 'output_last_hidden_state'):
            _check(getattr(self, name) in (None, 'all', 'generation'), name,
                   f"must be None, 'all' or 'generation', got {getattr(self, name)!r}")
        if self.logits_processors is not None:
            _check(all(callable(p) for p in self.logits_processors), 'logits_processors', 'must be callables')

    @property
    def is_greedy(self) -> bool:
        return (not self.do_sample) or self.top_k == 1 or self.temperature < GREEDY_TEMPERATURE


# 'auto', a built-in device ('cpu', 'cuda', 'ascend') or one an installed package registers (devices/registry.py)
DeviceType = str


# PytorchEngineConfig.model_format / --model-format (devices/layers.check_model_format)
MODEL_FORMATS = (None, 'hf', 'awq', 'gptq', 'smooth_quant')


@dataclass
class PytorchEngineConfig:
    """Engine settings (the fields of LMDeploy's ``PytorchEngineConfig``).

    cache_max_entry_count: fraction of the device memory left free after
        loading the weights that the KV cache takes (on cpu: of available RAM,
        capped by ``cpu_kv_cache_cap_gb``).
    num_gpu_blocks: if > 0, the exact number of KV blocks (overrides the above).
    max_prefill_token_num: most prompt tokens prefilled in one step; longer
        prompts are prefilled in chunks.
    """
    dtype: str = 'auto'
    tp: int = 1
    session_len: Optional[int] = None
    max_batch_size: Optional[int] = None
    cache_max_entry_count: float = 0.8
    block_size: int = 64
    num_gpu_blocks: int = 0
    max_prefill_token_num: int = 4096
    enable_prefix_caching: bool = False
    device_type: DeviceType = 'auto'
    eager_mode: bool = False
    quant_policy: int = 0
    cpu_kv_cache_cap_gb: float = 4.0
    # with graph replay, decode steps run alone (replayed) and a prefill step
    # (which carries the decoding sequences too) comes when a thirty-second of the
    # batch is free, or at most every this many decode steps
    prefill_interval: int = 16
    # run the engine loop in a process of its own (no interpreter lock shared with the caller's threads);
    # None: the API server does, pipeline() runs it in-process
    engine_process: Optional[bool] = None
    # run a few requests at start-up (long prompts, short bursts, every sampling kind) so that kernels a
    # device compiles on first use are compiled before the first real request; None: on for devices that
    # record steps (cuda, ascend), off where nothing is compiled (cpu)
    warmup: Optional[bool] = None
    # tp > 1: how the other ranks run: 'mp' (processes of this machine) or 'ray' (Ray actors, on the machines
    # of a Ray cluster); None: 'mp'
    distributed_executor_backend: Optional[str] = None
    # load a tokenizer the checkpoint ships as code (InternLM2, ChatGLM, Baichuan: tokenizer_config.json's
    # auto_map), as LMDeploy does; False refuses such a checkpoint (lmdeploy/tokenizer.py)
    trust_remote_code: bool = True
    # what the checkpoint's weights are, as LMDeploy's --model-format says it: None or 'hf' (whatever
    # config.json's quantization_config says), 'awq', 'gptq' or 'smooth_quant' (config.json must say the
    # same: the engine refuses a checkpoint that does not, before loading anything)
    model_format: Optional[str] = None
    # accepted for LMDeploy compatibility; no effect here
    num_cpu_blocks: int = 0
    thread_safe: bool = False
    download_dir: Optional[str] = None
    revision: Optional[str] = None

    def __post_init__(self):
        self.validate()

    def validate(self):
        name = 'PytorchEngineConfig.'
        _check(self.dtype in ('auto', 'float16', 'bfloat16', 'float32'), name + 'dtype',
               f"must be 'auto', 'float16', 'bfloat16' or 'float32', got {self.dtype!r}")
        _check(isinstance(self.tp, int) and self.tp >= 1, name + 'tp', f'must be >= 1, got {self.tp}')
        if self.session_len is not None:
            _check(isinstance(self.session_len, int) and self.session_len >= 2, name + 'session_len',
                   f'must be an integer >= 2, got {self.session_len!r}')
        if self.max_batch_size is not None:
            _check(isinstance(self.max_batch_size, int) and self.max_batch_size >= 1, name + 'max_batch_size',
                   f'must be an integer >= 1, got {self.max_batch_size!r}')
        _check(0.0 < self.cache_max_entry_count <= 1.0, name + 'cache_max_entry_count',
               f'must be in (0, 1], got {self.cache_max_entry_count}')
        _check(isinstance(self.block_size, int) and self.block_size >= 1 and
               (self.block_size & (self.block_size - 1)) == 0, name + 'block_size',
               f'must be a power of two, got {self.block_size!r}')
        _check(isinstance(self.num_gpu_blocks, int) and self.num_gpu_blocks >= 0, name + 'num_gpu_blocks',
               f'must be >= 0, got {self.num_gpu_blocks!r}')
        _check(isinstance(self.max_prefill_token_num, int) and self.max_prefill_token_num >= 1,
               name + 'max_prefill_token_num', f'must be >= 1, got {self.max_prefill_token_num!r}')
        from lmdeploy.devices.registry import device_choices  # no torch: just the names
        choices = device_choices()
        _check(self.device_type in choices, name + 'device_type',
               f'must be one of {choices}, got {self.device_type!r}')
        _check(self.engine_process in (None, True, False), name + 'engine_process',
               f'must be None, True or False, got {self.engine_process!r}')
        _check(self.warmup in (None, True, False), name + 'warmup', f'must be None, True or False, got {self.warmup!r}')
        _check(self.quant_policy in (0, 4, 8), name + 'quant_policy',
               f'must be 0, 4 or 8, got {self.quant_policy!r}')
        _check(self.trust_remote_code in (True, False), name + 'trust_remote_code',
               f'must be True or False, got {self.trust_remote_code!r}')
        _check(self.model_format in MODEL_FORMATS, name + 'model_format',
               f'must be one of {MODEL_FORMATS}, got {self.model_format!r}')
        _check(self.distributed_executor_backend in (None, 'mp', 'ray'), name + 'distributed_executor_backend',
               f"must be None, 'mp' or 'ray', got {self.distributed_executor_backend!r}")


@dataclass
class TurbomindEngineConfig:
    """Accepted for compatibility: mapped onto :class:`PytorchEngineConfig`."""
    dtype: str = 'auto'
    tp: int = 1
    session_len: Optional[int] = None
    max_batch_size: Optional[int] = None
    cache_max_entry_count: float = 0.8
    cache_block_seq_len: int = 64
    enable_prefix_caching: bool = False
    quant_policy: int = 0
    max_prefill_token_num: int = 8192
    num_tokens_per_iter: int = 0
    rope_scaling_factor: float = 0.0
    use_logn_attn: bool = False
    download_dir: Optional[str] = None
    revision: Optional[str] = None
    model_format: Optional[str] = None

    def to_pytorch(self, device_type: str = 'auto') -> PytorchEngineConfig:
        return PytorchEngineConfig(dtype=self.dtype, tp=self.tp, session_len=self.session_len,
                                   max_batch_size=self.max_batch_size,
                                   cache_max_entry_count=self.cache_max_entry_count,
                                   block_size=self.cache_block_seq_len,
                                   enable_prefix_caching=self.enable_prefix_caching,
                                   quant_policy=self.quant_policy,
                                   max_prefill_token_num=self.max_prefill_token_num,
                                   device_type=device_type, model_format=self.model_format)


class ResponseType(enum.Enum):
    SUCCESS = enum.auto()
    FINISH = enum.auto()
    INPUT_LENGTH_ERROR = enum.auto()
    CANCEL = enum.auto()
    INTERNAL_ENGINE_ERROR = enum.auto()


@dataclass
class Response:
    """One generation result (or, when streaming, one increment of it).

    logprobs: one dict per generated token, ``{token_id: logprob}`` with the
        top-N alternatives and the chosen token.
    prompt_logprobs: the same for each prompt token (GenerationConfig.prompt_logprobs); the first
        token's entry is None (nothing precedes it).
    logits / last_hidden_state: float tensors [num_tokens, dim] when asked for.
    """
    text: str
    generate_token_len: int
    input_token_len: int
    session_id: int = 0
    finish_reason: Optional[Literal['stop', 'length', 'error', 'abort']] = None
    token_ids: List[int] = field(default_factory=list)
    logprobs: Optional[List[Dict[int, float]]] = None
    logits: Any = None
    last_hidden_state: Any = None
    index: int = 0
    error: Optional[str] = None
    choice: int = 0  # which of the prompt's n samples (GenerationConfig.n)
    prompt_logprobs: Optional[List[Optional[Dict[int, float]]]] = None

    def __repr__(self):
        error = f', error={self.error!r}' if self.error else ''
        choice = f', choice={self.choice}' if self.choice else ''
        return (f'Response(text={self.text!r}, input_token_len={self.input_token_len}, '
                f'generate_token_len={self.generate_token_len}, finish_reason={self.finish_reason!r}, '
                f'session_id={self.session_id}, index={self.index}{choice}{error})')

    @property
    def refused(self) -> bool:
        """The request failed or was not taken (``error`` says why); a request that generated up to
        ``session_len`` and stopped there ('length' with tokens) is not refused."""
        return bool(self.error) and (self.finish_reason != 'length' or self.generate_token_len == 0)


class RequestError(ValueError):
    """A request the engine refused or failed (an invalid prompt or setting, a prompt over
    ``session_len``, an engine error). ``responses``: every result of the call, in input order (the
    refused ones with ``error`` set); ``index``: the first refused prompt's position."""

    def __init__(self, message: str, responses: Optional[List['Response']] = None, index: int = 0):
        super().__init__(message)
        self.responses = responses or []
        self.index = index
