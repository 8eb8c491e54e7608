"""EngineLike (lmdeploy/engine/protocol.py) is what the frontend may use of an engine: both engines
implement every member of it with a compatible signature, and the frontend and the server touch no
attribute of an engine outside it. No engine is started: signatures and sources are read."""
import ast
import inspect
import pathlib
import textwrap
from dataclasses import fields

import pytest

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.process import EngineProcess
from lmdeploy.engine.protocol import EngineInfo, EngineLike

ROOT = pathlib.Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = [Engine, EngineProcess]
DATA = set(EngineLike.__annotations__)
METHODS = {name for name, value in vars(EngineLike).items() if inspect.isfunction(value) and not name.startswith('_')}
MEMBERS = DATA | METHODS


def _plain(annotation) -> str:
    return annotation.strip('\'"') if isinstance(annotation, str) else getattr(annotation, '__name__', repr(annotation))


def signature_mismatches(proto, impl) -> list:
    """Ways in which ``impl`` cannot be called as ``proto`` is (empty: compatible)."""
    want, got = inspect.signature(proto), inspect.signature(impl)
    problems = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    wp = [p for p in want.parameters.values() if p.kind in positional]
    gp = [p for p in got.parameters.values() if p.kind in positional]
    takes_args = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in got.parameters.values())
    takes_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in got.parameters.values())
    for i, p in enumerate(wp):
        if i >= len(gp):
            if not takes_args:
                problems.append(f'no positional parameter {p.name!r}')
            continue
        q = gp[i]
        if q.name != p.name:
            problems.append(f'positional parameter {i} is {q.name!r}, not {p.name!r}')
        if p.default is not inspect.Parameter.empty and q.default != p.default:
            problems.append(f'{p.name!r} defaults to {q.default!r}, not {p.default!r}')
    for q in gp[len(wp):]:
        if q.default is inspect.Parameter.empty:
            problems.append(f'extra parameter {q.name!r} has no default')
    for p in want.parameters.values():
        if p.kind == inspect.Parameter.KEYWORD_ONLY:
            q = got.parameters.get(p.name)
            if q is None and not takes_kwargs:
                problems.append(f'no keyword parameter {p.name!r}')
    for q in got.parameters.values():
        if q.kind == inspect.Parameter.KEYWORD_ONLY and q.default is inspect.Parameter.empty \
                and q.name not in want.parameters:
            problems.append(f'extra keyword parameter {q.name!r} has no default')
    if want.return_annotation is not inspect.Signature.empty and got.return_annotation is not inspect.Signature.empty:
        if _plain(want.return_annotation) != _plain(got.return_annotation):
            problems.append(f'returns {got.return_annotation!r}, not {want.return_annotation!r}')
    return problems


def attributes_set(cls) -> set:
    """Attributes an instance has once built: ``self.x = ...`` in ``__init__`` (tuple targets too), and
    properties and other class attributes."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    names = set()

    def targets(node):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == 'self':
            names.add(node.attr)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                targets(elt)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                targets(t)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets(node.target)
    return names | {name for name in dir(cls) if not name.startswith('__')}


@pytest.mark.parametrize('cls', IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_method_of_the_protocol_is_implemented_with_a_compatible_signature(cls):
    assert {'submit', 'cancel', 'end_session', 'stats', 'wait_idle', 'check_invariants', 'is_alive',
            'close'} <= METHODS
    for name in sorted(METHODS):
        impl = inspect.getattr_static(cls, name, None)
        assert impl is not None and callable(impl), f'{cls.__name__} has no method {name}'
        assert signature_mismatches(getattr(EngineLike, name), getattr(cls, name)) == [], \
            f'{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} vs {inspect.signature(getattr(EngineLike, name))}'


@pytest.mark.parametrize('cls', IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_attribute_of_the_protocol_is_set_when_built(cls):
    assert {'model_config', 'session_len', 'num_blocks', 'block_size', 'max_batch_size'} <= DATA
    missing = DATA - attributes_set(cls)
    assert not missing, f'{cls.__name__} does not set {sorted(missing)}'


def test_the_engine_process_gets_every_size_from_its_child():
    """What the child sends when ready carries every data member, and the parent names each one."""
    assert DATA <= {f.name for f in fields(EngineInfo)}
    source = inspect.getsource(EngineProcess.__init__)
    assert 'setattr' not in source
    for name in DATA:
        assert f'self.{name}' in source and f'info.{name}' in source, name


def test_the_checker_catches_what_differs():
    class Bad:
        def submit(self, request): ...
        def wait_idle(self, timeout: float = 5.0) -> bool: ...
        def cancel(self, session_id, force): ...
        def stats(self) -> int: ...

    assert signature_mismatches(EngineLike.submit, Bad.submit)
    assert signature_mismatches(EngineLike.wait_idle, Bad.wait_idle)
    assert signature_mismatches(EngineLike.cancel, Bad.cancel)
    assert signature_mismatches(EngineLike.stats, Bad.stats)
    assert signature_mismatches(EngineLike.wait_idle, Engine.wait_idle) == []


# --------------------------------------------------------------- what the frontend touches
def _engine_like(node, aliases) -> bool:
    """``engine``, ``x.engine``, ``x.y.engine`` (not the package ``lmdeploy.engine``), or a name bound to one."""
    if isinstance(node, ast.Name):
        return node.id == 'engine' or node.id in aliases
    if isinstance(node, ast.Attribute) and node.attr == 'engine':
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        return not (isinstance(root, ast.Name) and root.id == 'lmdeploy')
    return False


def engine_uses(source: str) -> set:
    """(line, name) of every ``<engine>.name`` and ``getattr/hasattr(<engine>, 'name')`` in a module."""
    tree = ast.parse(source)
    aliases = set()
    for node in ast.walk(tree):  # e.g. eng = self.gateway.engine
        if isinstance(node, ast.Assign) and _engine_like(node.value, aliases):
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _engine_like(node.value, aliases):
            uses.add((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ('getattr', 'hasattr')
              and len(node.args) >= 2 and _engine_like(node.args[0], aliases)
              and isinstance(node.args[1], ast.Constant)):
            uses.add((node.lineno, node.args[1].value))
    return uses


def test_the_scan_finds_attribute_uses():
    uses = engine_uses(textwrap.dedent('''
        import lmdeploy.engine.process
        self.engine.submit(req)
        vocab = state.gateway.engine.model_config.vocab_size
        eng = gateway.engine
        eng.stats()
        getattr(gateway.engine, 'max_batch_size', None)
        lmdeploy.engine.process.EngineProcess
        engine.scheduler.idle
    '''))
    assert {name for _, name in uses} == {'submit', 'model_config', 'stats', 'max_batch_size', 'scheduler'}


def test_the_frontend_and_the_server_touch_only_the_protocol():
    found, outside = set(), []
    for folder in ('lmdeploy/frontend', 'lmdeploy/serve'):
        for path in sorted((ROOT / folder).rglob('*.py')):
            for line, name in engine_uses(path.read_text()):
                found.add(name)
                if name not in MEMBERS:
                    outside.append(f'{path.relative_to(ROOT)}:{line}: engine.{name}')
    assert not outside, 'engine members the frontend uses outside EngineLike:\n' + '\n'.join(outside)
    # the scan sees the gateway's and the server's uses (it is not vacuous)
    assert {'submit', 'cancel', 'end_session', 'close', 'stats', 'is_alive', 'model_config', 'session_len',
            'num_blocks', 'max_batch_size'} <= found
