"""``lmdeploy serve gradio``'s chat page in a real headless Chromium (Debian's chromium + chromedriver,
driven by selenium): streaming, history kept in the engine session, stop, reset, two tabs at once, and the
remote mode in front of an api_server. What the page claims is checked against the engine itself.

Skipped only where Chromium (or gradio / selenium) is missing and ``CI`` is not set."""
from __future__ import annotations

import os
import random
import shutil
import socket
import tempfile
import time

import pytest

CHROMIUM = '/usr/bin/chromium'
CHROMEDRIVER = '/usr/bin/chromedriver'
FLAGS = ('--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
         '--disable-background-networking', '--disable-component-update', '--disable-sync',
         '--window-size=1280,1100')
QUESTION = 'What is the capital of France?'
# gradio's queue calls pandas options that pandas 3 deprecates: not ours to fix
pytestmark = pytest.mark.filterwarnings('ignore:::gradio.queueing')
LONG = 'Write a very long story about a dragon who learns to fly, with many chapters.'


def _need(module: str):
    try:
        return __import__(module)
    except ImportError:
        if os.environ.get('CI'):
            pytest.fail(f'{module} is missing under CI (the test extra installs it)')
        pytest.skip(f'{module} is not installed')


def _need_chromium():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        if os.environ.get('CI'):
            pytest.fail(f'{missing} missing under CI (scripts/test.sh installs chromium and chromium-driver)')
        pytest.skip(f'{missing} not installed (scripts/test.sh installs chromium and chromium-driver)')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _artifact_dir() -> str:
    d = os.environ.get('CI_ARTIFACTS') or os.path.join(tempfile.gettempdir(), 'lmdeploy-gradio-test')
    os.makedirs(d, exist_ok=True)
    return d


def _wait(cond, timeout: float, what: str, step: float = 0.02):
    start = time.monotonic()
    while True:
        value = cond()
        took = time.monotonic() - start
        if value and took <= timeout:
            return value
        if took > timeout:  # (also when the condition came true, but later than that)
            raise AssertionError(f'waited {took:.2f} s (the bound: {timeout} s) for {what}')
        time.sleep(step)


def _spy(cls):
    """The backend class, recording each turn's (session, message, settings): how the test finds the
    engine session a tab uses, and checks that the page's sliders reached it."""

    class Spy(cls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.calls = []

        def stream(self, session, message, settings):
            self.calls.append((session, message, settings))
            return super().stream(session, message, settings)

        def stop(self, session):
            self.stopped_at = time.monotonic()
            return super().stop(session)

    return Spy


def _launch(page):
    port = _free_port()
    page.queue()
    page.launch(server_name='127.0.0.1', server_port=port, prevent_thread_lock=True, share=False, quiet=True)
    return f'http://127.0.0.1:{port}'


@pytest.fixture(scope='module')
def browser():
    _need_chromium()
    _need('gradio')
    _need('selenium')
    os.environ.setdefault('GRADIO_ANALYTICS_ENABLED', 'False')
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    profile = tempfile.mkdtemp(prefix='lmdeploy-chromium-')
    opts.add_argument(f'--user-data-dir={profile}')
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def say(capsys):
    """Print past pytest's capture: measurements and the screenshot's path show in a plain ``pytest -q``."""
    def _say(msg: str):
        with capsys.disabled():
            print(f'\n[gradio page] {msg}', flush=True)
    return _say


class Tab:
    """The chat page in one browser tab."""

    def __init__(self, driver, url: str):
        from selenium.webdriver.common.by import By
        self.d, self.By = driver, By
        self.handle = driver.current_window_handle
        driver.get(url)
        _wait(lambda: driver.find_elements(By.CSS_SELECTOR, '#message textarea'), 60, 'the page')

    def focus(self):
        self.d.switch_to.window(self.handle)

    def el(self, css):
        return self.d.find_element(self.By.CSS_SELECTOR, css)

    def set_number(self, elem_id: str, value):
        from selenium.webdriver.common.keys import Keys
        css = f'#{elem_id} input[type=number]'
        # (the settings render after the message box: on a busy machine a moment later)
        _wait(lambda: self.d.find_elements(self.By.CSS_SELECTOR, css), 30, elem_id)
        box = self.el(css)
        box.clear()
        box.send_keys(str(value), Keys.TAB)

    def send(self, text: str):
        self.sent_over = self.status()  # the status box before this turn (finish waits for another)
        self.el('#message textarea').send_keys(text)
        self.el('#send').click()

    def answer(self) -> str:
        return self.d.execute_script(
            "const b = document.querySelectorAll('#chatbot [data-testid=bot]');"
            "return b.length ? b[b.length - 1].innerText : '';")

    def num_answers(self) -> int:
        return len(self.d.find_elements(self.By.CSS_SELECTOR, '#chatbot [data-testid=bot]'))

    def status(self) -> str:
        return self.el('#status').text

    def finish(self, timeout: float = 90):
        """Poll until the turn ends; -> (final answer, the distinct partial answers seen before)."""
        seen = []

        def done():
            text = self.answer()
            if text and (not seen or seen[-1] != text):
                seen.append(text)
            # only the page's own end-of-turn words count: while a request is queued or starting, Gradio's
            # progress tracker may write other text into the status box; and only words other than those
            # shown when the message was sent (until the page's first update arrives, a second turn's box
            # still says how the first one finished; the token counts in it differ from turn to turn)
            status = self.status()
            return status != self.sent_over and status.startswith(
                ('finished', 'reached max new tokens', 'stopped', 'error'))

        _wait(done, timeout, 'the answer', step=0.03)
        final = self.answer()
        return final, [t for t in seen if t != final]


# ------------------------------------------------------------------ local model
@pytest.fixture(scope='module')
def local(smollm2_path, browser):
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.serve.gradio.local import LocalBackend
    from lmdeploy.serve.gradio.page import build_page
    config = PytorchEngineConfig(device_type='cpu', session_len=4096, num_gpu_blocks=96)
    backend = _spy(LocalBackend).from_model(smollm2_path, config)
    url = _launch(build_page(backend))
    yield backend, url
    backend.close()


def _engine_tokens(engine, session_id):
    assert engine.wait_idle(30)
    seq = engine.scheduler.idle.get(session_id)
    assert seq is not None, f'the engine holds no session {session_id}'
    return list(seq.token_ids)


def test_chat_streams_and_keeps_history(local, browser, say):
    backend, url = local
    engine = backend.engine
    tab = Tab(browser, url)
    tab.set_number('temperature', 0)
    tab.send(QUESTION)
    final, partial = tab.finish()
    assert 'Paris' in final, final
    assert partial and all(final.startswith(p.rstrip()) and len(p) < len(final) for p in partial), \
        ('no partial answer streamed in before the end', partial, final)
    session, message, settings = backend.calls[-1]
    assert message == QUESTION and settings.temperature == 0  # the slider reached the engine
    first = _engine_tokens(engine, session.session_id)
    assert session.finish_reason == 'stop'

    tab.send('Repeat your answer in one word.')
    final2, _ = tab.finish()
    assert final2 and tab.num_answers() == 2
    assert backend.calls[-1][0] is session and session.turns == 2
    second = _engine_tokens(engine, session.session_id)
    # the engine session grew by the new turn, and its tokens still start with the first turn's
    assert len(second) > len(first) and second[:len(first)] == first
    assert 'capital of France' in backend.pipeline.tokenizer.decode(second)
    assert session.input_tokens > len(first)  # the second prompt, as the engine counted it, held the first turn
    say(f'turn 1: {len(first)} tokens in the engine session; turn 2: {len(second)}; streamed '
          f'{len(partial)} partial answers before the first one ended')


def test_two_tabs_stop_and_reset(local, browser, say):
    backend, url = local
    engine = backend.engine
    for s in [c[0] for c in backend.calls]:  # free the earlier test's sessions: this one counts its own
        backend.reset(s)
    assert engine.wait_idle(30)
    _wait(lambda: engine.stats().num_idle_sessions == 0, 5, 'earlier sessions to be freed')
    a = Tab(browser, url)
    browser.switch_to.new_window('tab')
    b = Tab(browser, url)
    tabs = {}
    for tab in (a, b):
        tab.focus()
        tab.set_number('max_new_tokens', 1500)
        tab.send(LONG)
        def started():
            return backend.calls and backend.calls[-1][1] == LONG and \
                all(backend.calls[-1][0] is not s for s in tabs.values())

        _wait(started, 10, 'the turn to start')
        tabs[tab.handle] = backend.calls[-1][0]
    sa, sb = tabs[a.handle], tabs[b.handle]
    assert sa is not sb and sa.session_id != sb.session_id
    # both tabs generate at once, each in its own engine session
    _wait(lambda: engine.stats().num_running == 2, 20, 'two sequences running together')
    _wait(lambda: len(b.answer()) > 40, 30, "tab b's answer to grow")

    # stop in tab b: its generation ends within a second, tab a's goes on
    b.el('#stop').click()
    t0 = time.monotonic()
    # the engine's own lists, read without its lock (stats() waits for the step in flight)
    running = lambda: {q.session_id for q in list(engine.scheduler.running)}  # noqa: E731
    _wait(lambda: sb.session_id not in running() and sa.session_id in running(), 1.0,
          "tab b's generation to end in the engine")
    engine_s = time.monotonic() - t0
    _wait(lambda: not sb.generating, 1.0, "tab b's stream to end")
    stream_s = time.monotonic() - t0
    assert backend.stopped_at - t0 < 0.5  # the click reached the backend at once
    _wait(lambda: 'stopped' in b.status(), 1.0, "tab b's page to say stopped")
    page_s = time.monotonic() - t0
    assert sb.finish_reason == 'abort' and 0 < sb.generated_tokens < 1500 and sa.generating
    text = b.answer()
    time.sleep(0.3)
    assert b.answer() == text  # nothing more streams in

    a.focus()
    shot = os.path.join(_artifact_dir(), 'gradio_chat.png')
    a.el('#stop').click()
    t1 = time.monotonic()
    _wait(lambda: not sa.generating and not running(), 1.0, "tab a's generation to end")
    stop_a = time.monotonic() - t1
    _wait(lambda: 'stopped' in a.status(), 1.0, "tab a's page to say stopped")
    browser.save_screenshot(shot)
    say(f'stop in tab b: the engine ended it {engine_s * 1000:.0f} ms after the click, the stream '
          f'{stream_s * 1000:.0f} ms, the page said so {page_s * 1000:.0f} ms; tab a: {stop_a * 1000:.0f} ms; '
          f'screenshot: {shot}')
    assert engine.wait_idle(10) and engine.stats().num_idle_sessions == 2

    # reset frees the tab's engine session (and only that one)
    ids = (sa.session_id, sb.session_id)
    a.el('#reset').click()
    _wait(lambda: ids[0] not in engine.scheduler.idle, 2.0, "tab a's session to be freed")
    # the page clears its chat on its own round trip, which may land after the engine's release
    _wait(lambda: a.num_answers() == 0, 2.0, "tab a's page to clear its chat")
    assert ids[1] in engine.scheduler.idle
    # closing tab b frees its session too (the page's unload handler)
    b.focus()
    browser.close()
    browser.switch_to.window(a.handle)
    t2 = time.monotonic()
    _wait(lambda: ids[1] not in engine.scheduler.idle, 10.0, "the closed tab's session to be freed", step=0.05)
    say(f'closing tab b freed its engine session after {time.monotonic() - t2:.2f} s')
    assert engine.wait_idle(10)
    stats = engine.stats()
    assert stats.num_idle_sessions == 0 and stats.num_free_blocks == stats.num_blocks, stats
    engine.check_invariants()


# ----------------------------------------------------------------- remote mode
def test_remote_page_over_api_server(smollm2_path, browser, say):
    _need('fastapi')
    import httpx
    from lmdeploy.frontend.gateway import Gateway
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.serve.gradio.page import build_page
    from lmdeploy.serve.gradio.remote import RemoteBackend
    from lmdeploy.serve.openai.api_server import BackgroundServer, create_app
    gateway = Gateway(smollm2_path, PytorchEngineConfig(device_type='cpu', session_len=2048, num_gpu_blocks=32))
    server = BackgroundServer(create_app(gateway)).start()
    backend = _spy(RemoteBackend)(server.url)
    try:
        assert backend.check()
        tab = Tab(browser, _launch(build_page(backend)))
        tab.set_number('temperature', 0)
        tab.send(QUESTION)
        final, partial = tab.finish()
        assert 'Paris' in final and partial, (final, partial)

        def metric(name):
            for line in httpx.get(server.url + '/metrics').text.splitlines():
                if line.startswith(name + ' '):
                    return float(line.split()[1])
            raise KeyError(name)

        assert gateway.engine.wait_idle(10)
        assert metric('lmdeploy_num_idle_sessions') == 1  # the server kept the tab's session for its next turn
        tab.el('#reset').click()
        _wait(lambda: metric('lmdeploy_num_idle_sessions') == 0, 3.0, 'the server to free the session')
        assert metric('lmdeploy_kv_cache_blocks_free') == metric('lmdeploy_kv_cache_blocks_total')

        # stop through the server (the backend class directly): the stream ends within a second
        import threading
        from lmdeploy.serve.gradio.backend import ChatSession, ChatSettings
        session, pieces = ChatSession(), []
        worker = threading.Thread(target=lambda: pieces.extend(
            backend.stream(session, LONG, ChatSettings(max_new_tokens=1500))))
        worker.start()
        _wait(lambda: len(pieces) > 5 and metric('lmdeploy_num_requests_running') == 1, 30, 'the answer to start')
        backend.stop(session)
        t0 = time.monotonic()
        worker.join(1.0)
        took = time.monotonic() - t0
        assert not worker.is_alive(), 'the remote stream did not end within a second of stop'
        assert session.finish_reason == 'abort' and 0 < session.generated_tokens < 1500 and session.turns == 1
        say(f'remote stop: the stream ended {took * 1000:.0f} ms after the cancel')
        backend.reset(session)
        _wait(lambda: metric('lmdeploy_num_idle_sessions') == 0, 3.0, 'the server to free the session')
        gateway.engine.check_invariants()

        # a message the server refuses (longer than session_len): the reason, and a fresh start
        refused = ChatSession()
        long_text = ' '.join(random.choice(['apple', 'river', 'stone']) for _ in range(2500))
        assert list(backend.stream(refused, long_text, ChatSettings(max_new_tokens=8))) == []
        assert 'context length' in refused.error and refused.session_id is None, refused
        server.stop()
        gone = ChatSession()  # the server has gone away: said, not raised
        assert list(backend.stream(gone, QUESTION, ChatSettings())) == []
        assert 'failed' in gone.error and gone.session_id is None, gone
        backend.reset(gone)
    finally:
        backend.close()
        server.stop()
        gateway.close()


# ------------------------------------------------------------ the real command
def test_cli_serves_the_page(smollm2_path, browser):
    """``lmdeploy serve gradio`` (MODEL omitted: the embedded default model) serves a page that answers;
    Ctrl-C stops it."""
    import signal
    import subprocess
    import sys
    import threading

    import httpx
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = _free_port()
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED='False')
    env['PYTHONPATH'] = repo + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
    cmd = [sys.executable, '-m', 'lmdeploy', 'serve', 'gradio', '--server-name', '127.0.0.1', '--server-port',
           str(port), '--device', 'cpu', '--session-len', '1024', '--cache-max-entry-count', '0.01']
    from helpers import sigint_as_in_a_terminal
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=sigint_as_in_a_terminal)
    output = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    url = f'http://127.0.0.1:{port}'

    def up():
        assert proc.poll() is None, f'exited with {proc.returncode}:\n' + ''.join(output)
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait(up, 120, 'the page', step=0.2)
        tab = Tab(browser, url)
        tab.set_number('temperature', 0)
        tab.send(QUESTION)
        final, partial = tab.finish()
        assert 'Paris' in final and partial, (final, partial, ''.join(output))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) in (0, 130), ''.join(output)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        reader.join(10)
