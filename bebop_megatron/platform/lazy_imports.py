"""Importing Megatron-Core without the import-time work it does for features we do not use.

Measured on the development machine, importing the trainer took 5.5 s of CPU, in every process that
imports it (each tool, each rank), of which these three parts are work for nothing here:

- ``torch.compile`` wrappers built at import (about 2 s): ``megatron.core.jit`` sets
  ``jit_fuser = torch.compile``, its fusion modules (``megatron.core.fusions.fused_bias_geglu`` and
  others, imported by ``TransformerConfig``) decorate their functions with it, and
  ``megatron.core.transformer.moe.router`` decorates a method with ``@torch.compile``.
  ``torch.compile(fn)`` compiles nothing until ``fn`` is called, but building its wrapper imports
  ``torch._dynamo`` and ``torch._inductor``. Those modules run with ``torch.compile`` standing for
  :func:`lazy_compile`, which calls ``torch.compile(fn, **options)`` at ``fn``'s first call: the
  same compiled function, built later. Megatron's choice is kept where it is not ``torch.compile``
  (``disable_jit_fuser``, old torch).
- ``torch.use_deterministic_algorithms`` also sets ``torch._inductor.config.deterministic``, importing
  the inductor: :func:`use_deterministic_algorithms` sets the ATen flag alone, and
  :func:`lazy_compile` sets the inductor's when it builds a compiled function.
- ``megatron.core.timers`` imports wandb when it is installed (about 0.5 s), for Megatron's
  ``Timers.write(writer=wandb)``, which bebop_megatron does not use (its own logger imports wandb
  when ``logging.wandb`` is set): that module runs with wandb hidden, unless wandb was imported first.

:func:`install` (called by ``bebop_megatron/__init__.py``) applies this to the modules of
:data:`MODULES` imported from then on; ``torch.compile`` itself is unchanged outside their import,
and nothing changes for a module imported before :func:`install`. tests/test_lazy_imports.py checks it.
:func:`set_compile` (``False`` in CPU mode) makes the :func:`lazy_compile` functions run uncompiled;
tests/test_platform.py checks that.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys

COMPILE = "compile"  # run with torch.compile standing for lazy_compile
NO_WANDB = "no_wandb"  # run with wandb hidden
MODULES = {
    "megatron.core.jit": COMPILE,
    "megatron.core.transformer.moe.router": COMPILE,
    "megatron.core.timers": NO_WANDB,
}


def lazy_compile(fn=None, **options):
    """``torch.compile(fn, **options)``, built when the returned function is first called (without
    ``fn``: a decorator, as ``torch.compile(**options)`` is)."""
    if fn is None:
        return functools.partial(lazy_compile, **options)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if not _compile:
            return fn(*args, **kwargs)
        if compiled is None:
            import torch

            if torch.are_deterministic_algorithms_enabled():  # see use_deterministic_algorithms
                import torch._inductor.config as inductor_config

                inductor_config.deterministic = True
            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    call.uncompiled = fn
    return call


_compile = True  # False: lazy_compile's functions run as written (set_compile; CPU mode sets it)


def set_compile(enabled: bool) -> bool:
    """Whether :func:`lazy_compile`'s functions compile at their first call (the default) or run as
    written; returns the previous setting. CPU mode (``platform/cpu_mode.py``) turns compiling off:
    there the inductor builds C++ (a compiler must be installed) for each function, shape and
    process, seconds of CPU for element-wise functions whose eager time is microseconds."""
    global _compile
    previous, _compile = _compile, bool(enabled)
    return previous


def uncompiled(fn):
    """The function that a ``torch.compile`` or :func:`lazy_compile` wrapper runs (``fn`` itself
    when it is neither)."""
    return getattr(fn, "uncompiled", None) or getattr(fn, "_torchdynamo_orig_callable", fn)


def use_deterministic_algorithms(warn_only: bool = True) -> None:
    """``torch.use_deterministic_algorithms(True, warn_only=...)`` without importing the inductor
    (its ``deterministic`` flag is set here if it is imported, else by :func:`lazy_compile`)."""
    import torch

    if "torch._inductor.config" in sys.modules:
        sys.modules["torch._inductor.config"].deterministic = True
    torch._C._set_deterministic_algorithms(True, warn_only=warn_only)


@contextlib.contextmanager
def _compile_is_lazy():
    import torch

    real = torch.compile
    torch.compile = lazy_compile
    try:
        yield
    finally:
        torch.compile = real


@contextlib.contextmanager
def _wandb_hidden():
    hide = "wandb" not in sys.modules
    if hide:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError
    try:
        yield
    finally:
        if hide and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


class _Loader(importlib.abc.Loader):
    """A module's own loader, run inside its :data:`MODULES` context."""

    def __init__(self, loader, kind: str):
        self._loader, self._kind = loader, kind

    def __getattr__(self, name):  # get_source, get_code, ... for tracebacks and inspect
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with (_compile_is_lazy() if self._kind == COMPILE else _wandb_hidden()):
            self._loader.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, MODULES[name])
        return spec


def install() -> None:
    """Import the modules of :data:`MODULES` this way from now on (idempotent)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
