"""Mistral (``MistralForCausalLM``): Llama whose every layer attends within ``sliding_window`` tokens (a
query sees its last W positions, itself included, as transformers' Mistral masks them)."""
from __future__ import annotations

from .llama import LlamaAttention, LlamaForCausalLM


class MistralAttention(LlamaAttention):
    window_rule = 'all'


class MistralForCausalLM(LlamaForCausalLM):
    attention_cls = MistralAttention
