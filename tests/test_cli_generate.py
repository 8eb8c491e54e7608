"""``lmdeploy generate`` and the parser every subcommand shares: flags only when spelled out, an unknown
flag reported with the subcommand's own usage, the engine flags (``--session-len``) on generate, a refused
prompt said on stderr with exit status 2 (streamed or not), and ``lmdeploy chat`` starting a new session
when a turn no longer fits. In process, on the embedded model with a short session."""
import io
import re

import pytest

from lmdeploy import cli
from lmdeploy.cli.generate import build_gen_config
from lmdeploy.messages import PytorchEngineConfig


def _parse(*argv):
    return cli.build_parser().parse_args(list(argv))


def _usage_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        _parse(*argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize('argv, prog, bad', [
    (['generate', '--max-new-token', '5', 'Hi'], 'lmdeploy generate', '--max-new-token'),
    (['generate', 'Hi', '--sesion-len', '64'], 'lmdeploy generate', '--sesion-len'),
    (['chat', '--temp', '0.5'], 'lmdeploy chat', '--temp'),
    (['serve', 'api_server', '--server-por', '1'], 'lmdeploy serve api_server', '--server-por'),
    (['serve', 'gradio', '--inbrows'], 'lmdeploy serve gradio', '--inbrows'),
    (['serve', 'proxy', '--strat', 'random'], 'lmdeploy serve proxy', '--strat'),
    (['check_env', '--bogus'], 'lmdeploy check_env', '--bogus'),
    (['--bogus', 'list'], 'lmdeploy', '--bogus'),
])
def test_unknown_or_abbreviated_flag_shows_its_commands_usage(capsys, argv, prog, bad):
    err = _usage_error(capsys, *argv)
    assert err.startswith(f'usage: {prog} '), err
    assert f'{prog}: error: unrecognized arguments: {bad}' in err, err


def test_full_flag_names_still_parse():
    args = _parse('generate', 'Hi', 'there', '--max-new-tokens', '5', '--session-len', '64', '--device', 'cpu',
                  '--quant-policy', '8', '--temperature', '0.5', '--top-p', '0.9', '--stream')
    assert args.prompt == ['Hi', 'there'] and args.stream and args.model is None
    gen = build_gen_config(args)
    assert (gen.max_new_tokens, gen.do_sample, gen.temperature, gen.top_p) == (5, True, 0.5, 0.9)
    from lmdeploy.cli.common import build_engine_config
    assert build_engine_config(args) == PytorchEngineConfig(session_len=64, device_type='cpu', quant_policy=8)
    assert not build_gen_config(_parse('generate')).do_sample


def test_generate_bad_value_names_the_field(capsys):
    assert cli.main(['generate', '--session-len', '0', 'Hi']) == 2
    assert 'session_len' in capsys.readouterr().err


def _generate(capsys, smollm2_path, *argv):
    status = cli.main(['generate', '--model', smollm2_path, '--device', 'cpu', '--session-len', '48',
                       '--max-new-tokens', '3', *argv])
    return status, capsys.readouterr()


def test_generate_answers_and_refuses_what_does_not_fit(capsys, smollm2_path):
    status, out = _generate(capsys, smollm2_path, 'Hi')
    assert status == 0 and out.out.startswith('>>> Hi\n') and len(out.out) > len('>>> Hi\n') and not out.err, out
    long_prompt = 'x ' * 60
    for stream in ([], ['--stream']):
        # the prompt that fits is answered, the one that does not is said on stderr; status 2
        status, out = _generate(capsys, smollm2_path, *stream, 'Hi', long_prompt)
        assert status == 2, out
        answer, rest = out.out.split(f'>>> {long_prompt}\n')
        assert answer.startswith('>>> Hi\n') and len(answer) > len('>>> Hi\n') and rest == '', out.out
        assert re.fullmatch(r'error: the prompt has \d+ tokens \(with 0 from earlier turns\); session_len is 48 '
                            r'and prompt plus output must fit in it\n', out.err), (stream, out.err)


def test_chat_turn_that_no_longer_fits_starts_over(smollm2_path):
    """A turn refused because the session is full (finish_reason 'error' now, not 'length') still tells
    the chat loop to start a new session; a turn refused for another reason does not."""
    from lmdeploy import GenerationConfig, pipeline
    from lmdeploy.cli.chat import _turn
    from lmdeploy.frontend.pipeline import Session
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    with pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='cpu', session_len=96)) as pipe:
        session = Session(pipe.gateway.next_session_id())
        out = io.StringIO()
        assert _turn(pipe, session, 'x ' * 20, gen, 96, pipe.gateway.cancel, out) is True
        assert re.search(r'\[session \d+ \| turn 1 \|', out.getvalue()), out.getvalue()
        out = io.StringIO()
        assert _turn(pipe, session, 'x ' * 40, gen, 96, pipe.gateway.cancel, out) is False
        assert '[error: the prompt has' in out.getvalue() and 'session_len is 96' in out.getvalue()
        out = io.StringIO()
        assert _turn(pipe, session, 'Hi', GenerationConfig(stop_words=['\ud800']), 96, pipe.gateway.cancel,
                     out) is True
        assert 'stop_words' in out.getvalue()
        pipe.end_session(session)
