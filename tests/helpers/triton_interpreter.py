"""Triton's interpreter (``TRITON_INTERPRET=1``) without its repeated language patching.

Shared by the interpreted Triton cases (``triton_kernel_case.py``, ``lk_triton_case.py``,
``cold_start_triton_case.py``). A launch patches ``triton.language`` with the interpreter's
builtins once (``GridExecutor.__call__``), but every call of a ``@triton.jit`` *device*
function inside it (``_probs`` / ``_shifted`` of ``kernel_triton_jit``, ``tl.max`` / ``tl.sum``
of ``triton.language.standard``) patches the language modules visible from that function's
globals again (``InterpretedFunction.__call__``: ``inspect.getmembers`` over tl, tl.core,
tl.math, ..., and never restored). The patch is idempotent (a builtin already replaced is no
longer a builtin, the other attributes get equal wrappers), so repeating it for the globals of
a module already patched in this launch changes nothing but costs ~40% of an interpreted
kernel's time (triton 3.8: ~1.5 ms a device call, ~3 device calls per tile).

:func:`patch_once_per_launch` keeps the first patch of each module's globals in a launch and
skips the repeats, and memoises ``_get_np_dtype`` (a pure function of the type); everything
the interpreter computes, checks (overflow sanitising included) and raises is unchanged. Where triton's internals differ from those this relies on, it does
nothing (the interpreter stays as it is, only slower).
"""

from __future__ import annotations

_STATE: dict = {"patched": None}  # ids of the globals already patched in the running launch


def patch_once_per_launch() -> bool:
    """Install the skip (idempotent); True when installed, False where triton lacks the hooks."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_bebop_once_per_launch", False):
        return True
    if not all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return False
    patch_lang = interpreter._patch_lang
    launch = interpreter.GridExecutor.__call__

    def patch_lang_once(fn):
        patched = _STATE["patched"]
        if patched is None:  # outside a launch: as triton does
            return patch_lang(fn)
        key = id(fn.__globals__)
        if key in patched:  # already patched in this launch: an empty scope (restores nothing)
            return interpreter._LangPatchScope()
        patched.add(key)
        return patch_lang(fn)

    def launch_once(self, *args, **kwargs):
        outer = _STATE["patched"]
        _STATE["patched"] = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            _STATE["patched"] = outer

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_once
    if hasattr(interpreter, "_get_np_dtype"):
        interpreter._get_np_dtype = _memoised_np_dtype(interpreter._get_np_dtype)
    interpreter._bebop_once_per_launch = True
    return True


def _memoised_np_dtype(get_np_dtype):
    """``_get_np_dtype`` (the numpy dtype of a Triton type, which builds its table of 19 dtypes
    at every call: ~10% of an interpreted kernel's time), memoised for the scalar types and the
    blocks of them by the scalar's name (what that table is keyed by); pointers and anything
    else go to the original."""
    import triton.language as tl

    by_name: dict = {}

    def np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if type(tt_dtype) is tl.block_type else tt_dtype
        if type(scalar) is not tl.dtype:
            return get_np_dtype(tt_dtype)
        found = by_name.get(scalar.name)
        if found is None:
            found = by_name[scalar.name] = get_np_dtype(scalar)
        return found

    return np_dtype
