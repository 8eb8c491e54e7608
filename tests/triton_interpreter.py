"""Triton's interpreter (TRITON_INTERPRET=1, how the cuda device's kernels run in the tests without a GPU),
without its repeated set-up inside a launch.

The interpreter runs a kernel's Python with ``triton.language`` patched to its numpy builtins: a launch
(``GridExecutor.__call__``) patches the language modules its kernel's globals name (``tl`` and/or
``tl.core``) and restores them when the grid is done. But every call of a ``@triton.jit`` helper from inside
a kernel (``InterpretedFunction.__call__``: ``tl.sum``, ``tl.zeros``, ``tl.max``, ``tl.cdiv``, a kernel's own
helpers) patches the modules its globals name again, and never restores that patch. With the modules already
patched this changes nothing, yet it walks every member of each module (``inspect.getmembers``) and rebuilds
the tensor and core patches each time: measured a third of an attention test's time (a few thousand helper
calls per test).

:func:`install` has a launch patch ``tl`` and ``tl.core`` both before its own patch (restored after it, as
its own is), so that every module a helper can see is patched for the whole launch, and a helper called
inside a launch then runs without patching again. A helper called outside a launch, or one whose globals name
neither module, goes through the interpreter's own path. What a kernel computes is unchanged; the one
difference is that the interpreter's patches of ``tl.core`` no longer outlive a launch (where a helper's call
used to leave them in place, never restored).

A no-op where Triton is not interpreting, or where its interpreter lacks what this relies on (another Triton
version): the interpreter then runs as it is. LMDEPLOY_TEST_STOCK_INTERPRETER=1 leaves it as it is too."""
from __future__ import annotations

import inspect
import os
import sys
import threading

_installed = False


def install() -> bool:
    """Patch the interpreter once (see the module's docstring); True where it is (now or before)."""
    global _installed
    if _installed:
        return True
    if os.environ.get('TRITON_INTERPRET') != '1' or os.environ.get('LMDEPLOY_TEST_STOCK_INTERPRETER') == '1':
        return False
    interp = sys.modules.get('triton.runtime.interpreter')
    if interp is None:
        return False  # not imported yet: nothing interprets a kernel yet
    grid_cls, fn_cls = getattr(interp, 'GridExecutor', None), getattr(interp, 'InterpretedFunction', None)
    patch_lang, error, tl = (getattr(interp, name, None) for name in ('_patch_lang', 'InterpreterError', 'tl'))
    if None in (grid_cls, fn_cls, patch_lang, error, tl) or not all(
            callable(getattr(c, name, None)) for c, name in ((grid_cls, '__call__'), (fn_cls, '__call__'),
                                                             (fn_cls, 'rewrite'))):
        return False
    langs = (tl, tl.core)
    lang_ids = frozenset(id(m) for m in langs)
    local = threading.local()  # the launches running on this thread (innermost last)

    def seen(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in langs)

    def _both():  # a function whose globals name both modules, for the interpreter's own _patch_lang
        pass

    _both.__globals__.setdefault('_triton_language_for_interpreter', tl)
    _both.__globals__.setdefault('_triton_language_core_for_interpreter', tl.core)
    if seen(_both) != lang_ids:
        return False

    stock_launch, stock_call = grid_cls.__call__, fn_cls.__call__

    def launch(self, *args, **kwargs):
        both = patch_lang(_both)  # tl and tl.core for the whole launch; the kernel's own patch goes on top
        stack = local.__dict__.setdefault('launches', [])
        stack.append(lang_ids)
        try:
            return stock_launch(self, *args, **kwargs)
        finally:
            stack.pop()
            both.restore()

    def call(self, *args, **kwargs):
        stack = getattr(local, 'launches', None)
        names = seen(self.fn)
        if stack and names and names <= stack[-1]:  # inside a launch that patched every module it sees
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise error(repr(e)) from e
        return stock_call(self, *args, **kwargs)

    grid_cls.__call__, fn_cls.__call__ = launch, call
    _installed = True
    return True
