"""config.json parsing: every missing or malformed field is refused with a message naming the field and
the file (no KeyError, no silently wrong model); the configs the project builds and ships still load."""
import json
import os

import pytest

from lmdeploy import cli
from lmdeploy.engine.model_config import load_model_config

GOOD = {
    'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 64, 'num_hidden_layers': 2,
    'num_attention_heads': 4, 'num_key_value_heads': 2, 'intermediate_size': 128, 'vocab_size': 256,
    'max_position_embeddings': 512, 'rms_norm_eps': 1e-5, 'eos_token_id': 2, 'bos_token_id': 1,
    'rope_theta': 10000.0, 'tie_word_embeddings': False,
}


def _write(tmp_path, cfg, name='config.json'):
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


def test_a_good_config_loads(tmp_path):
    _write(tmp_path, GOOD)
    c = load_model_config(str(tmp_path))
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.num_layers) == (4, 2, 16, 64, 2)
    assert c.eos_token_ids == [2] and c.bos_token_id == 1 and c.rope.theta == 10000.0


def test_nulls_fall_back_and_nested_rope_reads(tmp_path):
    """Null optional fields count as absent; transformers 5's per-layer-type rope_parameters are read."""
    _write(tmp_path, dict(GOOD, num_key_value_heads=None, head_dim=None, sliding_window=None, bos_token_id=None,
                          rope_parameters={'full_attention': {'rope_type': 'linear', 'rope_theta': 5e5,
                                                              'factor': 2.0}}))
    c = load_model_config(str(tmp_path))
    assert c.num_kv_heads == 4 and c.head_dim == 16 and c.sliding_window is None and c.bos_token_id is None
    assert (c.rope.type, c.rope.theta, c.rope.factor) == ('linear', 5e5, 2.0)


@pytest.mark.parametrize('required', ['num_attention_heads', 'hidden_size', 'num_hidden_layers',
                                      'intermediate_size', 'vocab_size'])
def test_missing_required_field_is_named(tmp_path, required):
    path = _write(tmp_path, {k: v for k, v in GOOD.items() if k != required})
    with pytest.raises(ValueError) as e:
        load_model_config(str(tmp_path))
    assert str(e.value).startswith(f"{path}: field '{required}' is missing"), e.value


@pytest.mark.parametrize('change, field, says', [
    (dict(num_attention_heads='4'), 'num_attention_heads', "must be the number of attention heads, a positive "
     "integer, got '4'"),
    (dict(num_attention_heads=None), 'num_attention_heads', 'is null'),
    (dict(hidden_size=-64), 'hidden_size', 'got -64'),
    (dict(vocab_size=True), 'vocab_size', 'got True'),
    (dict(num_hidden_layers=2.5), 'num_hidden_layers', 'got 2.5'),
    (dict(num_key_value_heads=3), 'num_key_value_heads', 'must divide num_attention_heads (4), got 3'),
    (dict(hidden_size=66), 'head_dim', 'is missing and hidden_size (66) is not a multiple'),
    (dict(head_dim=0), 'head_dim', 'got 0'),
    (dict(rms_norm_eps='1e-5'), 'rms_norm_eps', "must be a positive number, got '1e-5'"),
    (dict(tie_word_embeddings='yes'), 'tie_word_embeddings', "must be true or false, got 'yes'"),
    (dict(model_type=7), 'model_type', 'must be a string'),
    (dict(architectures=[1]), 'architectures', 'must be a list of class names'),
    (dict(eos_token_id='</s>'), 'eos_token_id', "must be a token id (an integer >= 0) or a list of them"),
    (dict(rope_theta='big'), 'rope_theta', "must be a positive number, got 'big'"),
    (dict(rope_scaling='linear'), 'rope_scaling', "must be an object, got 'linear'"),
    (dict(rope_scaling={'rope_type': 'linear', 'factor': 'x'}), 'rope_scaling.factor', 'must be a positive number'),
    (dict(rope_scaling={'rope_type': 'llama3', 'factor': 8.0}), 'rope_scaling.original_max_position_embeddings',
     "is missing (a positive integer, for rope type 'llama3')"),
    (dict(rope_parameters={'rope_type': 'default', 'rope_theta': -1}), 'rope_parameters.rope_theta', 'got -1'),
    (dict(sliding_window='4k'), 'sliding_window', "must be an integer >= 0, got '4k'"),
    (dict(text_config=[1], hidden_size=None), 'text_config', 'must be an object'),
])
def test_malformed_field_is_named(tmp_path, change, field, says):
    cfg = {k: v for k, v in dict(GOOD, **change).items() if not (k == 'hidden_size' and v is None)}
    path = _write(tmp_path, cfg)
    with pytest.raises(ValueError) as e:
        load_model_config(str(tmp_path))
    assert str(e.value).startswith(f'{path}: field {field!r} '), e.value
    assert says in str(e.value), e.value


def test_unsupported_rope_type_names_the_file(tmp_path):
    path = _write(tmp_path, dict(GOOD, rope_scaling={'rope_type': 'yarn', 'factor': 4.0}))
    with pytest.raises(ValueError, match=rf"^{path}: rope type 'yarn' \(rope_scaling\) is not supported"):
        load_model_config(str(tmp_path))


@pytest.mark.parametrize('text, says', [('{"hidden_size": 64,\n}', 'is not valid JSON: Expecting property name '
                                         'enclosed in double quotes at line 2, column 1'),
                                        ('[1, 2]', 'must hold a JSON object, got list')])
def test_unreadable_json_names_the_file(tmp_path, text, says):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as e:
        load_model_config(str(tmp_path))
    assert str(e.value) == f'{path} {says}'


def test_generation_config_is_checked_too(tmp_path):
    _write(tmp_path, GOOD)
    path = _write(tmp_path, {'eos_token_id': [2, 'x']}, 'generation_config.json')
    with pytest.raises(ValueError, match=rf"^{path}: field 'eos_token_id' must be a token id"):
        load_model_config(str(tmp_path))
    _write(tmp_path, {'eos_token_id': [7, 2]}, 'generation_config.json')
    assert load_model_config(str(tmp_path)).eos_token_ids == [2, 7]


def test_the_cli_says_it_in_one_line(tmp_path, capsys):
    """`lmdeploy generate` on such a directory: one 'error:' line naming field and file, exit status 2."""
    path = _write(tmp_path, {k: v for k, v in GOOD.items() if k != 'num_attention_heads'})
    assert cli.main(['generate', '--model', str(tmp_path), '--device', 'cpu', 'Hi']) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: {path}: field 'num_attention_heads' is missing (the number of attention " \
                          "heads, a positive integer)", err


def test_shipped_and_test_models_load(smollm2_path, tiny_models):
    """Every real config the project meets (the default model, every tiny test model) passes the checks."""
    for path in [smollm2_path, *tiny_models.values()]:
        c = load_model_config(path)
        assert c.num_heads % c.num_kv_heads == 0 and c.head_dim > 0, path
        assert c.eos_token_ids, os.path.join(path, 'config.json')
