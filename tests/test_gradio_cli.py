"""``lmdeploy serve gradio``'s flags (nothing started) and its refusals."""
from __future__ import annotations

import socket

import pytest

from lmdeploy import cli
from lmdeploy.cli.serve_gradio import build_gradio_kwargs


def _args(*argv):
    return cli.build_parser().parse_args(['serve', 'gradio', *argv])


def test_local_flags(tmp_path):
    (tmp_path / 'config.json').write_text('{}')
    kw = build_gradio_kwargs(_args(str(tmp_path), '--server-name', '127.0.0.1', '--server-port', '7000',
                                   '--device', 'cpu', '--session-len', '1024', '--enable-prefix-caching'))
    assert kw['target'] == str(tmp_path) and kw['server_name'] == '127.0.0.1' and kw['server_port'] == 7000
    cfg = kw['backend_config']
    assert cfg.device_type == 'cpu' and cfg.session_len == 1024 and cfg.enable_prefix_caching
    assert build_gradio_kwargs(_args(str(tmp_path)))['server_port'] == 6006


def test_default_model(smollm2_path):
    assert build_gradio_kwargs(_args())['target'] == smollm2_path


def test_remote_flags():
    kw = build_gradio_kwargs(_args('http://example.org:23333/', '--api-key', 'k'))
    assert kw['target'] == 'http://example.org:23333' and kw['api_key'] == 'k' and 'backend_config' not in kw


@pytest.mark.parametrize('argv, msg', [(['--server-port', '70000'], 'server-port'),
                                       (['--session-len', '0'], 'session_len')])
def test_bad_values(tmp_path, argv, msg):
    with pytest.raises(ValueError, match=msg):
        build_gradio_kwargs(_args(str(tmp_path), *argv))


def test_missing_model_is_an_error(tmp_path, capsys):
    assert cli.main(['serve', 'gradio', str(tmp_path / 'nope')]) == 2
    assert 'does not exist' in capsys.readouterr().err


def test_unreachable_server_is_an_error(capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    assert cli.main(['serve', 'gradio', f'http://127.0.0.1:{port}']) == 2
    err = capsys.readouterr().err
    assert 'cannot reach the api_server' in err or "lmdeploy[gradio]" in err, err


def test_the_page_says_its_address_not_gradios_share_hint(smollm2_path, capsys, monkeypatch):
    """`lmdeploy serve gradio` prints where the page is and nothing about `share=True` in `launch()` (Gradio's
    banner), which a user of the command line cannot set. Run as the command runs it (block=True), with the
    wait for Ctrl-C cut short."""
    gr = pytest.importorskip('gradio')
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.serve.gradio.page import address_line, run
    waited = []
    monkeypatch.setattr(gr.Blocks, 'block_thread', lambda self: waited.append(self.is_running))
    page, backend = run(smollm2_path, server_name='127.0.0.1', server_port=_free_port(),
                        backend_config=PytorchEngineConfig(device_type='cpu'), block=True)
    try:
        out = capsys.readouterr().out
        assert waited == [True]
        assert out == address_line('127.0.0.1', page.server_port) + '\n', out
        assert out.startswith(f'lmdeploy serve gradio: the chat page is at http://127.0.0.1:{page.server_port};')
        assert 'share' not in out
    finally:
        page.close()
    assert address_line('0.0.0.0', 6006).startswith('lmdeploy serve gradio: the chat page is at '
                                                    'http://127.0.0.1:6006 (listening on all addresses')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]
