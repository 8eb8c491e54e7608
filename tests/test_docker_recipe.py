"""The Docker images' recipe, checked without a Docker daemon: the Dockerfiles lint clean (hadolint) and
follow the images' conventions, the install script is valid shell (shellcheck), and the cpu variant's
install, run in a fresh virtual environment exactly as the cpu image runs it, gives a server that
answers a question.

That install (a fresh venv: torch, lmdeploy and its dependencies, the default model converted into a
fresh cache; about 2 CPU minutes of single-threaded pip and conversion) is begun when collection is done,
at the lowest priority, like the other long work of tests/background.py, and its test runs last."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from background import BACKGROUND_POPEN, Background, lower_priority

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(ROOT, 'dockerfiles')
DEVICES = ('cpu', 'cuda', 'ascend')
IN_CI = os.environ.get('CI') in ('true', '1')


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if path is None:
        if IN_CI:
            pytest.fail(f'{name} is missing (the test extra installs it)')
        pytest.skip(f'{name} is not installed')
    return path


def _dockerfile(device: str) -> str:
    with open(os.path.join(DOCKER, f'Dockerfile.{device}')) as f:
        return f.read()


@pytest.mark.parametrize('device', DEVICES)
def test_dockerfile_lints_clean(device):
    hadolint = _tool('hadolint')
    run = subprocess.run([hadolint, '--config', os.path.join(DOCKER, '.hadolint.yaml'), '--no-color',
                          os.path.join(DOCKER, f'Dockerfile.{device}')], capture_output=True, text=True)
    assert run.returncode == 0 and not run.stdout.strip(), run.stdout + run.stderr


@pytest.mark.parametrize('device', DEVICES)
def test_dockerfile_conventions(device):
    text = _dockerfile(device)
    assert f'dockerfiles/install.sh {device}' in text  # the one recipe
    assert re.search(r'^ENTRYPOINT \["lmdeploy"\]$', text, re.M)
    assert re.search(rf'^CMD \["serve", "api_server", "--device", "{device}",', text, re.M)
    assert re.search(r'^HEALTHCHECK .*\n?.*/health', text, re.M)
    users = re.findall(r'^USER (\S+)$', text, re.M)
    assert users and users[-1].split(':')[0] not in ('0', 'root')  # the final stage runs unprivileged
    assert 'LMDEPLOY_MODEL=/models' in text and 'mkdir -p /models' in text
    assert re.search(r'^ARG TORCH_VERSION=', text, re.M)
    assert not re.search(r'(?i)(api_key|token|password|secret)\s*=', text)


def test_install_script_is_valid_shell():
    script = os.path.join(DOCKER, 'install.sh')
    subprocess.run(['bash', '-n', script], check=True)
    run = subprocess.run([_tool('shellcheck'), script], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
    bad = subprocess.run(['bash', script, 'tpu', ROOT], capture_output=True, text=True)
    assert bad.returncode == 2 and 'unknown device' in bad.stderr


def test_mounted_model_or_the_default(monkeypatch, tmp_path, smollm2_path):
    """The images set LMDEPLOY_MODEL=/models: a model mounted there is served, an empty /models gives the
    embedded default (with a warning), an explicit MODEL argument wins."""
    from lmdeploy.default_model import default_model_path, resolve_model_path
    monkeypatch.setenv('LMDEPLOY_MODEL', str(tmp_path))
    assert resolve_model_path(None) == default_model_path()
    os.symlink(os.path.join(smollm2_path, 'config.json'), tmp_path / 'config.json')
    assert resolve_model_path(None) == str(tmp_path)
    assert resolve_model_path(smollm2_path) == os.path.abspath(smollm2_path)


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read()


class _Install:
    """``python -m venv`` then ``dockerfiles/install.sh cpu`` in it (a fresh model cache too), in a temporary
    directory, as one shell in a subprocess at the lowest priority (tests/background.py)."""

    def __init__(self):
        self.tmp = tempfile.mkdtemp(prefix='lmdeploy-docker-recipe-')
        self.venv = os.path.join(self.tmp, 'venv')
        self.python = os.path.join(self.venv, 'bin', 'python')
        env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'VIRTUAL_ENV')}
        env.update(PYTHON=self.python, LMDEPLOY_CACHE=os.path.join(self.tmp, 'cache'),
                   LMDEPLOY_MODEL=os.path.join(self.tmp, 'models'),
                   PATH=os.path.join(self.venv, 'bin') + os.pathsep + env.get('PATH', ''))
        self.env = env
        os.makedirs(os.path.join(self.tmp, 'models'))
        self.out = tempfile.TemporaryFile('w+')
        self.err = tempfile.TemporaryFile('w+')
        self.start, self.returncode = time.monotonic(), None
        # one shell: the venv (made by this interpreter), then the recipe in it
        script = '"$0" -m venv "$VENV" && exec bash "$1" cpu "$2"'
        self.proc = subprocess.Popen(['bash', '-c', script, sys.executable, os.path.join(DOCKER, 'install.sh'), ROOT],
                                     env=dict(env, VENV=self.venv), cwd=self.tmp, stdout=self.out, stderr=self.err,
                                     text=True, **BACKGROUND_POPEN)
        lower_priority(self.proc.pid)

    def result(self, timeout: float):
        """This job, its install finished: ``returncode``, ``output`` (the ends of its stdout and stderr),
        ``elapsed`` (seconds from its start to its end, mostly in the background)."""
        if self.returncode is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.cancel()
                pytest.fail(f'install.sh cpu took over {timeout:.0f} s')
            self.elapsed = time.monotonic() - self.start
            self.out.seek(0)
            self.err.seek(0)
            self.output = self.out.read()[-3000:] + self.err.read()[-3000:]
            self.returncode = self.proc.returncode
        return self

    def pids(self):
        return [self.proc.pid]

    def cancel(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # pip and its children too
            self.proc.wait()
        self.out.close()
        self.err.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


background = Background(
    serves=lambda item: getattr(item, 'originalname', None) == 'test_cpu_recipe_in_a_fresh_venv_answers_a_question',
    begin=lambda items: _Install())


@pytest.fixture(scope='module')
def installed(request):
    """The finished install (begun in the background, or now when nothing began it)."""
    return background.result(request.session, timeout=900)


def test_cpu_recipe_in_a_fresh_venv_answers_a_question(installed):
    """dockerfiles/install.sh cpu in a new virtual environment (a fresh model cache too), then the image's
    command: `lmdeploy serve api_server --device cpu` with an empty /models."""
    assert installed.returncode == 0, installed.output
    print(f'\ninstall.sh cpu in a fresh venv: done {installed.elapsed:.0f} s after it began (in the background)')
    venv, python, env, tmp = installed.venv, installed.python, installed.env, installed.tmp
    # the package came from the recipe, not from this checkout
    where = subprocess.run([python, '-c', 'import lmdeploy; print(lmdeploy.__file__)'], env=env, cwd=tmp,
                           capture_output=True, text=True, check=True).stdout
    assert venv in where
    from lmdeploy.engine.parallel.group import free_port
    port = free_port('127.0.0.1')
    server = subprocess.Popen([os.path.join(venv, 'bin', 'lmdeploy'), 'serve', 'api_server', '--device', 'cpu',
                               '--server-name', '127.0.0.1', '--server-port', str(port), '--session-len', '512',
                               '--cache-max-entry-count', '0.01'], env=env, cwd=tmp,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f'http://127.0.0.1:{port}'
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                if _get(url + '/health')[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            assert time.monotonic() < deadline, 'the server did not become healthy'
            time.sleep(0.3)
        model = json.loads(_get(url + '/v1/models')[1])['data'][0]['id']
        body = json.dumps({'model': model, 'max_tokens': 16, 'temperature': 0,
                           'messages': [{'role': 'user', 'content': 'What is the capital of France?'}]}).encode()
        req = urllib.request.Request(url + '/v1/chat/completions', body, {'Content-Type': 'application/json'})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())['choices'][0]['message']['content']
        assert 'Paris' in answer, answer
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
