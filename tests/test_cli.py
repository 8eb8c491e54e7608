"""The ``lmdeploy`` command line: serve flag mapping (no server started),
list, check_env, --version, and the interactive chat driven through a
pseudo-terminal."""
import json
import os
import re
import subprocess
import sys
import types

import pytest
from helpers import sigint_as_in_a_terminal

from lmdeploy import cli
from lmdeploy.cli.chat import build_gen_config
from lmdeploy.cli.serve import build_serve_kwargs
from lmdeploy.frontend.chat_template import ChatTemplateConfig
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.version import __version__

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
    return subprocess.run([sys.executable, '-m', 'lmdeploy', *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def _serve_args(*argv):
    return cli.build_parser().parse_args(['serve', 'api_server', *argv])


# ------------------------------------------------------------------ serve
def test_serve_defaults(tmp_path):
    kw = build_serve_kwargs(_serve_args(str(tmp_path)))
    assert kw['model_path'] == str(tmp_path)
    assert kw['server_name'] == '0.0.0.0' and kw['server_port'] == 23333
    assert kw['backend'] == 'pytorch'
    assert kw['backend_config'] == PytorchEngineConfig()  # every engine default kept
    assert kw['chat_template_config'] is None and kw['model_name'] is None
    assert kw['api_keys'] is None and kw['ssl'] is False
    assert kw['allow_origins'] == ['*'] and kw['allow_methods'] == ['*'] and kw['allow_headers'] == ['*']
    assert kw['allow_credentials'] is False
    assert kw['log_level'] == 'WARNING' and kw['max_log_len'] is None


def test_serve_all_flags(tmp_path):
    kw = build_serve_kwargs(
        _serve_args(str(tmp_path), '--server-name', '127.0.0.1', '--server-port', '8000', '--allow-origins',
                    'http://a', 'http://b', '--allow-credentials', '--allow-methods', 'GET', 'POST',
                    '--allow-headers', 'X-A', '--backend', 'pytorch', '--device', 'cpu', '--eager-mode',
                    '--api-keys', 'k1', 'k2', '--ssl', '--model-name', 'smol', '--chat-template', 'llama3', '--tp',
                    '1', '--session-len', '4096', '--max-batch-size', '16', '--cache-max-entry-count', '0.5',
                    '--cache-block-seq-len', '32', '--enable-prefix-caching', '--quant-policy', '8',
                    '--max-prefill-token-num', '1024', '--dtype', 'bfloat16', '--log-level', 'INFO',
                    '--max-log-len', '100'))
    assert kw['server_name'] == '127.0.0.1' and kw['server_port'] == 8000
    assert kw['allow_origins'] == ['http://a', 'http://b'] and kw['allow_credentials'] is True
    assert kw['allow_methods'] == ['GET', 'POST'] and kw['allow_headers'] == ['X-A']
    assert kw['api_keys'] == ['k1', 'k2'] and kw['ssl'] is True and kw['model_name'] == 'smol'
    assert kw['chat_template_config'] == ChatTemplateConfig(model_name='llama3')
    assert kw['log_level'] == 'INFO' and kw['max_log_len'] == 100
    assert kw['backend_config'] == PytorchEngineConfig(
        dtype='bfloat16', tp=1, session_len=4096, max_batch_size=16, cache_max_entry_count=0.5, block_size=32,
        enable_prefix_caching=True, device_type='cpu', eager_mode=True, quant_policy=8, max_prefill_token_num=1024)


def test_serve_default_model(smollm2_path):
    assert build_serve_kwargs(_serve_args())['model_path'] == smollm2_path
    assert build_serve_kwargs(_serve_args('default'))['model_path'] == smollm2_path


def test_serve_turbomind_is_mapped(tmp_path, capsys):
    kw = build_serve_kwargs(_serve_args(str(tmp_path), '--backend', 'turbomind'))
    assert kw['backend'] == 'pytorch' and isinstance(kw['backend_config'], PytorchEngineConfig)
    assert 'turbomind' in capsys.readouterr().err


def test_serve_chat_template_json(tmp_path):
    path = tmp_path / 'tpl.json'
    path.write_text(json.dumps({'model_name': 'chatml', 'meta_instruction': 'Be brief.'}))
    kw = build_serve_kwargs(_serve_args(str(tmp_path), '--chat-template', str(path)))
    assert kw['chat_template_config'] == ChatTemplateConfig(model_name='chatml', meta_instruction='Be brief.')


@pytest.mark.parametrize('argv,msg', [
    (['--chat-template', 'no-such-template'], 'unknown chat template'),
    (['--chat-template', 'missing.json'], 'does not exist'),
    (['--cache-block-seq-len', '48'], 'block_size'),
    (['--cache-max-entry-count', '1.5'], 'cache_max_entry_count'),
    (['--server-port', '70000'], 'server-port'),
])
def test_serve_bad_values(tmp_path, argv, msg):
    with pytest.raises((ValueError, FileNotFoundError), match=msg):
        build_serve_kwargs(_serve_args(str(tmp_path), *argv))


@pytest.mark.parametrize('argv', [['--quant-policy', '3'], ['--device', 'tpu'], ['--backend', 'vllm']])
def test_serve_bad_choices(tmp_path, argv):
    with pytest.raises(SystemExit):
        _serve_args(str(tmp_path), *argv)


def test_serve_missing_model_is_an_error(tmp_path, capsys):
    assert cli.main(['serve', 'api_server', str(tmp_path / 'nope')]) == 2
    assert 'does not exist' in capsys.readouterr().err


def test_serve_calls_serve(tmp_path, monkeypatch):
    """The handler passes the mapped arguments to serve() (a stand-in here)."""
    calls = []
    fake = types.ModuleType('lmdeploy.serve.openai.api_server')
    fake.serve = lambda model_path, **kw: calls.append((model_path, kw))
    monkeypatch.setitem(sys.modules, 'lmdeploy.serve.openai.api_server', fake)
    argv = [str(tmp_path), '--server-port', '9000', '--device', 'cpu', '--api-keys', 'secret']
    assert cli.main(['serve', 'api_server', *argv]) == 0
    expected = build_serve_kwargs(_serve_args(*argv))
    assert calls == [(expected.pop('model_path'), expected)]


def test_serve_kwargs_fit_the_real_serve(tmp_path):
    """Every keyword build_serve_kwargs makes is one serve() accepts."""
    try:
        from lmdeploy.serve.openai.api_server import serve
    except ImportError as e:  # written concurrently; or the 'serve' extra is missing
        pytest.skip(f'lmdeploy.serve.openai.api_server is not importable: {e}')
    import inspect
    kw = build_serve_kwargs(_serve_args(str(tmp_path)))
    inspect.signature(serve).bind(kw.pop('model_path'), **kw)


# ---------------------------------------------------------------- chat flags
def _chat_args(*argv):
    return cli.build_parser().parse_args(['chat', *argv])


def test_chat_sampling_flags():
    gen = build_gen_config(_chat_args())
    assert not gen.do_sample and gen.is_greedy and gen.random_seed is None
    gen = build_gen_config(_chat_args('--temperature', '0.7', '--top-p', '0.9', '--top-k', '20', '--seed', '3',
                                      '--repetition-penalty', '1.1', '--max-new-tokens', '64'))
    assert gen.do_sample and not gen.is_greedy
    assert (gen.temperature, gen.top_p, gen.top_k, gen.random_seed, gen.repetition_penalty,
            gen.max_new_tokens) == (0.7, 0.9, 20, 3, 1.1, 64)
    gen = build_gen_config(_chat_args('--do-sample'))
    assert gen.do_sample and gen.temperature == 0.8
    assert build_gen_config(_chat_args('--do-sample', '--temperature', '0')).is_greedy


# ------------------------------------------------------- list / version / env
def test_list(capsys):
    assert cli.main(['list']) == 0
    names = capsys.readouterr().out.split()
    assert 'llama3' in names and 'chatml' in names


def test_version_and_list_subprocess():
    r = _run('--version')
    assert r.returncode == 0 and r.stdout.strip() == __version__
    r = _run('list')
    assert r.returncode == 0
    assert {'llama3', 'chatml'} <= set(r.stdout.split())


def test_check_env():
    r = _run('check_env', timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for label in ('Python', 'OS', 'torch', 'CUDA available', 'transformers', 'lmdeploy devices'):
        assert label in out
    ops = ('rms_norm', 'silu_and_mul', 'apply_rotary', 'rotary_fill_kv', 'argmax', 'paged_decode_attention',
           'paged_prefill_attention', 'sample')
    for op in ops:
        assert re.search(rf'^\s*cpu\s+{op}\s+PASS\b', out, re.M), out
    assert 'FAIL' not in out


def test_check_env_self_test_catches_a_wrong_op():
    import torch

    from lmdeploy.devices.conformance import run_self_tests
    from lmdeploy.devices.cpu import CpuOps

    class Broken(CpuOps):

        def silu_and_mul(self, x):
            gate, up = x.chunk(2, dim=-1)
            return torch.sigmoid(gate) * up

        def argmax(self, x):  # ties go to the last index instead of the first
            return x.shape[-1] - 1 - x.flip(-1).argmax(dim=-1)

        def rotary_fill_kv(self, q, k, v, cos, sin, cache, slot_mapping):
            return super().rotary_fill_kv(q, k, v.flip(0), cos, sin, cache, slot_mapping)  # rows swapped

    results = {r.op: r.passed for r in run_self_tests('cpu', Broken())}
    assert results['silu_and_mul'] is False and results['argmax'] is False and results['rotary_fill_kv'] is False
    assert results['rms_norm'] is True and results['paged_decode_attention'] is True


# ---------------------------------------------------------------- chat REPL
_STATUS = re.compile(r'\[session (\d+) \| turn (\d+) \| prompt (\d+) tokens \| reply (\d+) tokens \| '
                     r'context (\d+)/\d+ tokens')


def _spawn_chat(model, *argv):
    pexpect = pytest.importorskip('pexpect')
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
    child = pexpect.spawn(sys.executable, ['-m', 'lmdeploy', 'chat', model, '--device', 'cpu', *argv],
                          cwd=REPO, env=env, encoding='utf-8', timeout=90, dimensions=(50, 200),
                          preexec_fn=sigint_as_in_a_terminal)
    child.expect('>>> ')
    return pexpect, child


def test_chat_keeps_the_session(smollm2_path):
    pexpect, child = _spawn_chat(smollm2_path, '--max-new-tokens', '24')
    try:
        child.sendline('My name is Alice.')
        child.expect(_STATUS)
        sid1, turn1, prompt1, reply1, context1 = map(int, child.match.groups())
        assert turn1 == 1 and reply1 >= 1 and context1 == prompt1 + reply1
        child.expect('>>> ')
        question = 'What is my name?'
        child.sendline(question)
        child.expect(_STATUS)
        sid2, turn2, prompt2, reply2, context2 = map(int, child.match.groups())
        # the same session: the second prompt holds the whole first exchange plus the question
        from transformers import AutoTokenizer
        n_question = len(AutoTokenizer.from_pretrained(smollm2_path).encode(question, add_special_tokens=False))
        assert sid2 == sid1 and turn2 == 2
        assert prompt2 >= context1 + n_question, (prompt1, reply1, prompt2)
        child.expect('>>> ')
        child.sendline('exit')
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_chat_ctrl_c_stops_the_answer_and_eof_quits(smollm2_path):
    pexpect, child = _spawn_chat(smollm2_path, '--max-new-tokens', '4000', '--ignore-eos')
    try:
        child.sendline('Tell me a long story.')
        child.expect(r'Tell me a long story\.\r?\n')  # the echo
        child.expect(r'\w+')  # the answer has started
        child.sendintr()
        child.expect(r'\[stopped\]')
        child.expect(_STATUS)
        assert int(child.match.group(4)) < 4000
        child.expect('>>> ')
        child.sendintr()  # at the prompt: the REPL stays
        child.expect('>>> ')
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
