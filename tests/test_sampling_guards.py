"""Sampling settings that float32 cannot honour, and faults the sampler must not turn into tokens.

* GenerationConfig: a temperature below GREEDY_TEMPERATURE decodes greedily (1e-46 is 0 in float32:
  dividing logits by it gave NaN); NaN / infinite temperatures and penalties <= 0 or not finite are
  refused by name.
* The sampler: a processed row without a finite logit to draw from reaches the host as NO_TOKEN (the
  engine fails that request as its own fault), while the token the next step reads stays a valid id.
* The model's generation_config.json read as sampling defaults (what the server uses where a request is
  silent).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from lmdeploy.devices import get_device
from lmdeploy.engine.sampler import NO_TOKEN, sample_tokens
from lmdeploy.engine.sequence import SamplingParams, Sequence
from lmdeploy.frontend.sampling_defaults import SamplingDefaults, load_sampling_defaults, sampling_defaults
from lmdeploy.messages import GREEDY_TEMPERATURE, GenerationConfig


# ------------------------------------------------------------------ GenerationConfig
@pytest.mark.parametrize('temperature', [0.0, 5e-324, 1e-300, 1e-46, GREEDY_TEMPERATURE / 2])
def test_temperature_below_the_threshold_is_greedy(temperature):
    assert torch.tensor(temperature, dtype=torch.float32).item() < GREEDY_TEMPERATURE
    assert GenerationConfig(do_sample=True, temperature=temperature).is_greedy


@pytest.mark.parametrize('temperature', [GREEDY_TEMPERATURE, 0.7, 2.0])
def test_temperature_at_the_threshold_samples(temperature):
    assert not GenerationConfig(do_sample=True, temperature=temperature).is_greedy


@pytest.mark.parametrize('field,value', [('temperature', math.nan), ('temperature', math.inf),
                                         ('repetition_penalty', 0.0), ('repetition_penalty', -1.0),
                                         ('repetition_penalty', math.nan), ('repetition_penalty', math.inf),
                                         ('repetition_penalty', -math.inf)])
def test_unusable_values_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf'GenerationConfig\.{field} must be a finite number'):
        GenerationConfig(**{field: value})


def test_tiny_repetition_penalty_is_accepted():
    assert GenerationConfig(repetition_penalty=1e-46).repetition_penalty == 1e-46


# ------------------------------------------------------------------ the sampler
def _seq(i: int, params: SamplingParams) -> Sequence:
    return Sequence(i, i, [1, 2, 3], params, lambda out: None, max_len=64)


def test_rows_without_finite_logits_reach_the_host_as_no_token():
    torch.manual_seed(0)
    logits = torch.randn(4, 32)
    logits[1] = float('nan')  # a NaN row, sampled
    logits[3, :] = float('-inf')  # nothing left to draw from, greedy with a penalty (a processed row)
    seqs = [_seq(0, SamplingParams(greedy=False, temperature=0.8, seed=1)),
            _seq(1, SamplingParams(greedy=False, temperature=0.8, seed=2)),
            _seq(2, SamplingParams(greedy=True, repetition_penalty=1.3)),
            _seq(3, SamplingParams(greedy=True, repetition_penalty=1.3))]
    tokens, drawn = sample_tokens(logits, seqs, get_device('cpu'))
    assert drawn.tolist()[1] == NO_TOKEN and drawn.tolist()[3] == NO_TOKEN
    assert drawn[0] == tokens[0] and drawn[2] == tokens[2]
    assert ((tokens >= 0) & (tokens < 32)).all()  # what the next step reads stays a valid id
    # the healthy rows are what they are alone
    alone, _ = sample_tokens(logits[[0, 2]], [seqs[0], seqs[2]], get_device('cpu'))
    assert alone.tolist() == [tokens[0].item(), tokens[2].item()]


def test_plain_greedy_rows_are_not_checked():
    logits = torch.randn(2, 16)
    seqs = [_seq(0, SamplingParams()), _seq(1, SamplingParams())]
    tokens, drawn = sample_tokens(logits, seqs, get_device('cpu'))
    assert drawn is tokens and tokens.tolist() == logits.argmax(-1).tolist()


# ------------------------------------------------------------------ generation_config.json
@pytest.mark.parametrize('config,expected', [
    ({}, SamplingDefaults()),  # transformers' reading: no do_sample, no temperature -> greedy
    ({'bos_token_id': 1, 'eos_token_id': 2}, SamplingDefaults()),
    ({'do_sample': True}, SamplingDefaults(temperature=1.0)),
    ({'do_sample': True, 'temperature': 0.6, 'top_p': 0.9}, SamplingDefaults(temperature=0.6, top_p=0.9)),
    ({'temperature': 0.7, 'top_k': 20, 'repetition_penalty': 1.05},
     SamplingDefaults(temperature=0.7, top_k=20, repetition_penalty=1.05)),  # vLLM's reading
    ({'do_sample': False, 'temperature': 0.7, 'top_p': 0.8}, SamplingDefaults(top_p=0.8)),
    ({'do_sample': True, 'temperature': -1, 'top_p': 3, 'top_k': 2.5, 'min_p': 0.05},
     SamplingDefaults(temperature=1.0, min_p=0.05)),  # out of range: ignored
])
def test_sampling_defaults(config, expected):
    assert sampling_defaults(config) == expected


def test_load_sampling_defaults(tmp_path, smollm2_path):
    assert load_sampling_defaults(str(tmp_path)) == SamplingDefaults()  # no file
    (tmp_path / 'generation_config.json').write_text('{not json')
    assert load_sampling_defaults(str(tmp_path)) == SamplingDefaults()
    (tmp_path / 'generation_config.json').write_text(json.dumps({'do_sample': True, 'temperature': 0.3}))
    assert load_sampling_defaults(str(tmp_path)) == SamplingDefaults(temperature=0.3)
    # the default model's file names no sampling settings: greedy, as transformers reads it
    assert load_sampling_defaults(smollm2_path) == SamplingDefaults()
