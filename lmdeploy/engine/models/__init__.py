"""Model registry: config.json's ``architectures`` (or ``model_type``) -> class."""
from __future__ import annotations

from ..model_config import ModelConfig
from .baichuan import BaichuanForCausalLM, BaiChuanForCausalLM
from .falcon import FalconForCausalLM
from .gemma import GemmaForCausalLM
from .gemma2 import Gemma2ForCausalLM
from .gemma3 import Gemma3ForCausalLM
from .glm import ChatGLMForCausalLM, Glm4ForCausalLM, GlmForCausalLM
from .internlm2 import InternLM2ForCausalLM
from .internlm3 import InternLM3ForCausalLM
from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from .starcoder2 import Starcoder2ForCausalLM

ARCHITECTURES = {
    'LlamaForCausalLM': LlamaForCausalLM,
    'MistralForCausalLM': MistralForCausalLM,
    'YiForCausalLM': LlamaForCausalLM,
    'Qwen2ForCausalLM': Qwen2ForCausalLM,
    'Qwen3ForCausalLM': Qwen3ForCausalLM,
    'InternLM2ForCausalLM': InternLM2ForCausalLM,
    'InternLM3ForCausalLM': InternLM3ForCausalLM,
    'Phi3ForCausalLM': Phi3ForCausalLM,
    'GemmaForCausalLM': GemmaForCausalLM,
    'Gemma2ForCausalLM': Gemma2ForCausalLM,
    'Gemma3ForCausalLM': Gemma3ForCausalLM,
    'GlmForCausalLM': GlmForCausalLM,
    'Glm4ForCausalLM': Glm4ForCausalLM,
    'ChatGLMModel': ChatGLMForCausalLM,
    'ChatGLMForConditionalGeneration': ChatGLMForCausalLM,
    'BaichuanForCausalLM': BaichuanForCausalLM,
    'BaiChuanForCausalLM': BaiChuanForCausalLM,
    'Starcoder2ForCausalLM': Starcoder2ForCausalLM,
    'FalconForCausalLM': FalconForCausalLM,
}
MODEL_TYPES = {
    'llama': LlamaForCausalLM,
    'mistral': MistralForCausalLM,
    'yi': LlamaForCausalLM,
    'qwen2': Qwen2ForCausalLM,
    'qwen3': Qwen3ForCausalLM,
    'internlm2': InternLM2ForCausalLM,
    'internlm3': InternLM3ForCausalLM,
    'phi3': Phi3ForCausalLM,
    'gemma': GemmaForCausalLM,
    'gemma2': Gemma2ForCausalLM,
    'gemma3_text': Gemma3ForCausalLM,
    'glm': GlmForCausalLM,
    'glm4': Glm4ForCausalLM,
    'chatglm': ChatGLMForCausalLM,
    'baichuan': BaichuanForCausalLM,
    'starcoder2': Starcoder2ForCausalLM,
    'falcon': FalconForCausalLM,
}

# architectures that are known and refused, with the reason (instead of a bare "not supported")
REFUSED = {
    'Gemma3ForConditionalGeneration': 'it is Gemma 3\'s vision-language model (gemma-3-4b/12b/27b); only its '
                                      'text-only form, Gemma3ForCausalLM (e.g. gemma-3-1b), is supported',
}


def get_model_class(cfg: ModelConfig):
    if cfg.architecture in REFUSED:
        raise ValueError(f'architecture {cfg.architecture!r} is not supported: {REFUSED[cfg.architecture]}')
    if cfg.architecture:
        if cfg.architecture in ARCHITECTURES:
            return ARCHITECTURES[cfg.architecture]
        raise ValueError(f'architecture {cfg.architecture!r} is not supported; supported architectures: '
                         f'{sorted(ARCHITECTURES)}')
    if cfg.model_type in MODEL_TYPES:
        return MODEL_TYPES[cfg.model_type]
    raise ValueError(f'config.json has no architectures and model_type {cfg.model_type!r} is not supported; '
                     f'supported architectures: {sorted(ARCHITECTURES)}')


__all__ = ['ARCHITECTURES', 'MODEL_TYPES', 'REFUSED', 'get_model_class']
