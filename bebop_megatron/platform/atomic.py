"""Files written whole or not at all: a crash, a full disk or an exception in the writer leaves
the previous file (or none) in place, never a truncated one.

The data go to ``PATH.tmp`` in the same directory, are flushed and fsync'ed, and then
``os.replace`` renames the temporary file over ``PATH`` (atomic on POSIX file systems). On an
exception the temporary file is removed and the exception propagates.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["atomic_open", "write_atomic"]


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, encoding: str | None = None, fsync: bool = True):
    """``open(PATH.tmp, mode)`` for writing; on a clean exit the file replaces ``path``.

    ``mode`` is ``"w"`` (text, UTF-8 unless ``encoding`` says otherwise) or ``"wb"``. The parent
    directory is created. ``fsync=False`` skips the flush to disk (a cache that can be rebuilt).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode {mode!r}; use 'w' or 'wb'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if mode == "w" and encoding is None:
        encoding = "utf-8"
    try:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes, *, fsync: bool = True) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` through :func:`atomic_open`."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w", fsync=fsync) as f:
        f.write(data)
