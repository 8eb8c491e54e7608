"""The README says what the code does: its Python block runs as written (on a CPU, in well under a
minute), every ``lmdeploy`` command and flag it shows parses, the files it names exist, its install
commands install from this checkout, the test command it gives is the one CI runs, and its claims about
refused requests and JSON output hold."""
import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib

import pytest

from lmdeploy import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, 'README.md')).read()
FOREIGN = ('pip', 'ray', 'docker', 'curl', 'apt-get', 'python', 'bash')  # commands that are not lmdeploy's


def _python_block() -> str:
    return re.search(r'## Python API\s+```python\n(.*?)```', README, re.S).group(1)


def _commands():
    """Every command of the README's bash blocks, as its words (continuations joined, `&&` split)."""
    for block in re.findall(r'```bash\n(.*?)```', README, re.S):
        pending = ''
        for line in block.replace('\\\n', ' ').splitlines():
            pending += line + '\n'
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quoted argument over several lines
                continue
            pending = ''
            cmd = []
            for w in words + ['&&']:
                if w == '&&':
                    if cmd:
                        yield cmd
                    cmd = []
                else:
                    cmd.append(w)


def _inline_code():
    return re.findall(r'`([^`\n]+)`', README)


def _parsers(parser=None, path=('lmdeploy', )):
    """(command path, parser) for the lmdeploy parser and every subcommand's."""
    import argparse
    parser = parser or cli.build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name, ))


def test_readme_python_block_runs_as_written(smollm2_path):
    block = _python_block()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    start = time.monotonic()
    run = subprocess.run([sys.executable, '-c', block], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    took = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count('Response(text=') == 2, run.stdout[-2000:]  # the batch of two
    assert re.search(r'^\[\d+\.\d+\]$', run.stdout, re.M), run.stdout[-2000:]  # get_ppl's list
    print(f'README block: {took:.1f} s')


def test_readme_python_block_ends_the_streamed_line():
    """The statement after the stream_infer loop is a bare print(): the next output starts on a line of its own."""
    body = ast.parse(_python_block()).body
    i = next(i for i, node in enumerate(body) if isinstance(node, ast.For) and 'stream_infer' in ast.unparse(node.iter))
    assert ast.unparse(body[i + 1]) == 'print()', ast.unparse(body[i + 1])


def test_readme_config_arguments_are_fields():
    """Every keyword the README passes to a config class (in code blocks and inline) is one of its fields."""
    import dataclasses

    from lmdeploy import ChatTemplateConfig, GenerationConfig, PytorchEngineConfig
    classes = {c.__name__: {f.name for f in dataclasses.fields(c)}
               for c in (GenerationConfig, PytorchEngineConfig, ChatTemplateConfig)}
    sources = re.findall(r'```python\n(.*?)```', README, re.S) + [s for s in _inline_code() if '(' in s]
    seen = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in classes:
                for kw in node.keywords:
                    assert kw.arg in classes[node.func.id], f'{node.func.id}({kw.arg}=...) in the README'
                    seen.add((node.func.id, kw.arg))
    assert ('PytorchEngineConfig', 'device_type') in seen and ('GenerationConfig', 'max_new_tokens') in seen
    listed = re.search(r'- `GenerationConfig`: (.*?)\.\n', README, re.S).group(1)
    for name in re.split(r',\s*', listed):
        assert name in classes['GenerationConfig'], f'GenerationConfig has no field {name!r} (README list)'


def test_readme_commands_parse():
    """Every `lmdeploy ...` line of the README's bash blocks parses with the real parser (nothing started)."""
    parser = cli.build_parser()
    commands = [c for c in _commands() if c[0] == 'lmdeploy']
    assert len(commands) >= 10
    for words in commands:
        try:
            args = parser.parse_args(words[1:])
        except SystemExit as e:
            pytest.fail(f'README: {shlex.join(words)!r} does not parse (exit {e.code})')
        assert getattr(args, 'func', None), shlex.join(words)


def test_readme_names_every_command_and_every_named_command_exists():
    paths = {' '.join(path) for path, _ in _parsers()}
    leaves = {p for p in paths if p.count(' ') == 2 or p in ('lmdeploy chat', 'lmdeploy generate',
                                                                'lmdeploy check_env', 'lmdeploy list')}
    assert leaves == {'lmdeploy serve api_server', 'lmdeploy serve proxy', 'lmdeploy serve gradio',
                      'lmdeploy chat', 'lmdeploy generate', 'lmdeploy lite auto_awq', 'lmdeploy lite auto_gptq',
                      'lmdeploy lite smooth_quant', 'lmdeploy lite calibrate',
                      'lmdeploy check_env', 'lmdeploy list'}
    for path in leaves:
        assert f'`{path}' in README or f'\n{path}' in README, f'the README never shows {path!r}'
    for span in _inline_code():
        if span.startswith('lmdeploy '):
            words = [w for w in re.sub(r'\[.*?\]', '', span).split() if not w.startswith('-') and not w.isupper()]
            assert ' '.join(words) in paths, f'README: `{span}` is not an lmdeploy command'


def test_readme_flags_exist():
    """A flag the README shows inline is one of an lmdeploy command's, or one a script it names reads."""
    options = {o for _, p in _parsers() for a in p._actions for o in a.option_strings}
    scripts = ''.join(open(os.path.join(d, f)).read() for d in (os.path.join(ROOT, 'benchmark'),
                                                              os.path.join(ROOT, 'csrc'))
                      for f in os.listdir(d) if f.endswith('.py'))
    checked = 0
    for span in _inline_code():
        if span.split()[0] in FOREIGN[:5]:
            continue
        for flag in re.findall(r'(?<![\w-])--[a-z][\w-]*', span):
            checked += 1
            assert flag in options or f"'{flag}'" in scripts, f'README: {flag} (in `{span}`) exists nowhere'
    assert checked >= 20
    for words in _commands():  # python benchmark/x.py --flag ...: the script reads each flag
        if words[0] == 'python' and words[1].endswith('.py'):
            text = open(os.path.join(ROOT, words[1])).read()
            for flag in (w for w in words[2:] if w.startswith('--')):
                assert f"'{flag}'" in text, f'README: {words[1]} has no {flag}'


def test_readme_paths_exist():
    """Every repository path the README names (a top-level directory first, or a file name with its
    extension) is there: `devices/cuda/splits.py` would not be."""
    tops = {d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d))} | {'.ci'}
    named = set(re.findall(r'(?<![\w/.:-])((?:[\w.-]+/)+[\w.-]*\w)(?![\w/])', README))
    checked = [p for p in named if p.split('/')[0] in tops or re.search(r'\.(py|md|sh|json|toml)$', p)]
    assert len(checked) >= 30
    missing = sorted(p for p in checked if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, f'the README names paths that do not exist: {missing}'


def test_readme_installs_from_the_checkout():
    """`pip install 'lmdeploy[x]'` would fetch lmdeploy from the registry: every extra is installed as
    `pip install -e '.[x]'`, and each extra exists."""
    assert not re.search(r"pip install[^`\n]*['\"]?lmdeploy\[", README)
    with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
        extras = set(tomllib.load(f)['project']['optional-dependencies'])
    used = re.findall(r"pip install -e '\.\[([\w,-]+)\]'", README)
    assert {'structured', 'serve', 'gradio', 'ray', 'default-model', 'test'} <= {e for u in used
                                                                                  for e in u.split(',')}
    for group in used:
        assert set(group.split(',')) <= extras, group


def test_readme_test_command_is_what_ci_runs():
    """CI runs the README's test command, and that command installs Chromium for the browser tests;
    the README's description of scripts/test.sh is what the script does."""
    assert 'bash scripts/test.sh' in [shlex.join(c) for c in _commands()]
    ci = [line for line in open(os.path.join(ROOT, '.ci', 'run')).read().splitlines()
          if line.strip() and not line.startswith(('#', 'set ', 'cd '))]
    assert ci == ['bash scripts/test.sh'], ci
    script = open(os.path.join(ROOT, 'scripts', 'test.sh')).read()
    assert 'apt-get install -y -qq chromium chromium-driver' in script
    described = re.search(r"\(`scripts/test.sh` installs .*? then runs (`[^`]+`)", README, re.S).group(1)
    def plain(text):  # the script runs pip and pytest as python modules, quietly
        return text.replace('python -m ', '').replace(' -q', '')

    for step in described.strip('`').split(' && '):
        assert plain(step) in plain(script), f'scripts/test.sh does not run {step!r}'
    assert re.search(r'^Suite duration: about \d+ minutes on 2 CPU cores\.$', README, re.M)


def _install_chromium(tmp_path, *, root=True, sudo=False, present=False):
    """Run scripts/test.sh's install_chromium with apt-get (and id, sudo) replaced by programs that log
    their arguments: which commands it would run."""
    body = re.search(r'^install_chromium\(\) \{\n.*?^\}\n', open(os.path.join(ROOT, 'scripts', 'test.sh')).read(),
                     re.S | re.M).group(0)
    bin_dir, log = tmp_path / 'bin', tmp_path / 'log'
    bin_dir.mkdir(parents=True)
    programs = {'apt-get': f'echo "apt-get $*" >> {log}', 'id': f'echo {0 if root else 1000}'}
    if sudo:
        programs['sudo'] = f'[ "$1" = -n ] && shift && [ "$1" = true ] && exit 0; echo "sudo" >> {log}; exec "$@"'
    if present:
        programs.update(chromium='true', chromedriver='true')
    for name, text in programs.items():
        (bin_dir / name).write_text(f'#!/bin/sh\n{text}\n')
        (bin_dir / name).chmod(0o755)
    os.symlink(shutil.which('env'), bin_dir / 'env')
    run = subprocess.run(['/bin/bash', '-c', f'set -euo pipefail\n{body}\ninstall_chromium'], capture_output=True,
                         text=True, timeout=30, env={'PATH': str(bin_dir)})
    assert run.returncode == 0, run.stderr
    return (log.read_text() if log.exists() else ''), run.stderr


def test_test_script_installs_chromium_where_it_can(tmp_path):
    calls, _ = _install_chromium(tmp_path / 'root')
    assert calls == 'apt-get update -qq\napt-get install -y -qq chromium chromium-driver\n'
    calls, _ = _install_chromium(tmp_path / 'sudo', root=False, sudo=True)
    assert calls == 'sudo\napt-get update -qq\nsudo\napt-get install -y -qq chromium chromium-driver\n'
    calls, note = _install_chromium(tmp_path / 'user', root=False)
    assert calls == '' and 'browser tests skip' in note
    calls, note = _install_chromium(tmp_path / 'there', present=True)
    assert calls == '' and note == ''


def test_json_output_is_as_the_readme_says(tokenizer):
    """'JSON is emitted on one line, with one space after each `,` and `:` and no other whitespace'."""
    pytest.importorskip('xgrammar')
    from lmdeploy.engine.grammar import Grammars, spec_from_response_format
    assert 'JSON is emitted on one line, with\n  one space after each `,` and `:`' in README
    grammars = Grammars(tokenizer, len(tokenizer))
    spec = spec_from_response_format({'type': 'json_object'})
    accepts = {text: grammars.matcher(spec).accept_string(text)
               for text in ('{"a": 1, "b": [1, 2]}', '{"a":1}', '{"a": 1,"b": 2}', '{ "a": 1}', '{"a":\n1}')}
    assert accepts == {'{"a": 1, "b": [1, 2]}': True, '{"a":1}': False, '{"a": 1,"b": 2}': False,
                       '{ "a": 1}': False, '{"a":\n1}': False}


def test_refused_stream_is_an_error_as_the_readme_says(smollm2_path):
    """'`stream_infer` yields it as a final `Response` with `finish_reason='error'` and the reason in `error`'."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig, RequestError, pipeline
    assert "`stream_infer` yields it as a final\n`Response` with `finish_reason='error'`" in README
    with pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='cpu', session_len=32)) as pipe:
        last = list(pipe.stream_infer('x ' * 40, GenerationConfig(max_new_tokens=4)))[-1]
        assert last.finish_reason == 'error' and 'session_len' in last.error and last.refused
        with pytest.raises(RequestError) as e:
            pipe('x ' * 40, GenerationConfig(max_new_tokens=4))
        assert e.value.responses[0].finish_reason == 'error'
