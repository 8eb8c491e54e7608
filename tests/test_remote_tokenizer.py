"""A checkpoint whose tokenizer is its own code (tokenizer_config.json's ``auto_map``, as InternLM2/2.5's
``tokenization_internlm2_fast.py``, ChatGLM's and Baichuan's are): it runs by default, as LMDeploy runs it, and is
refused with a message saying how to allow it when ``trust_remote_code`` is off. The checkpoint here is SmolLM2
with its tokenizer wrapped in a class of the checkpoint's own module."""
from __future__ import annotations

import json
import os

import pytest

from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy.tokenizer import load_tokenizer, remote_tokenizer_code

CODE = '''from transformers import PreTrainedTokenizerFast


class CheckpointTokenizer(PreTrainedTokenizerFast):
    """The checkpoint's own tokenizer class (tokenizer.json underneath)."""
    vocab_files_names = {'tokenizer_file': 'tokenizer.json'}
    ran_checkpoint_code = True
'''


@pytest.fixture(scope='module')
def remote_dir(smollm2_path, tmp_path_factory):
    out = tmp_path_factory.mktemp('remote_tokenizer')
    for name in os.listdir(smollm2_path):
        if name != 'tokenizer_config.json':
            os.symlink(os.path.join(smollm2_path, name), out / name)
    with open(os.path.join(smollm2_path, 'tokenizer_config.json')) as f:
        cfg = json.load(f)
    cfg.update(tokenizer_class='CheckpointTokenizer',
               auto_map={'AutoTokenizer': [None, 'tokenization_checkpoint.CheckpointTokenizer']})
    (out / 'tokenizer_config.json').write_text(json.dumps(cfg))
    (out / 'tokenization_checkpoint.py').write_text(CODE)
    return str(out)


def test_remote_tokenizer_runs_by_default_and_answers(remote_dir):
    assert remote_tokenizer_code(remote_dir) == 'tokenization_checkpoint.CheckpointTokenizer'
    with pipeline(remote_dir, PytorchEngineConfig(device_type='cpu', session_len=512)) as pipe:
        assert type(pipe.gateway.tokenizer).__name__ == 'CheckpointTokenizer'
        assert pipe.gateway.tokenizer.ran_checkpoint_code
        resp = pipe('What is the capital of France?', GenerationConfig(max_new_tokens=24))
        assert 'Paris' in resp.text


def test_remote_tokenizer_refused_without_trust(remote_dir):
    with pytest.raises(ValueError, match=r'tokenization_checkpoint\.CheckpointTokenizer.*trust_remote_code=True'):
        pipeline(remote_dir, PytorchEngineConfig(device_type='cpu', session_len=512, trust_remote_code=False))
    with pytest.raises(ValueError, match='--trust-remote-code'):
        load_tokenizer(remote_dir, trust_remote_code=False)


def test_plain_checkpoints_need_no_trust(smollm2_path):
    assert remote_tokenizer_code(smollm2_path) is None
    assert type(load_tokenizer(smollm2_path, trust_remote_code=False)).__name__ != 'CheckpointTokenizer'


def test_cli_flag_reaches_the_config():
    import argparse

    from lmdeploy.cli.common import add_engine_args, build_engine_config
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert build_engine_config(parser.parse_args([])).trust_remote_code is True
    assert build_engine_config(parser.parse_args(['--no-trust-remote-code'])).trust_remote_code is False
