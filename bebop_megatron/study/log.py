"""The study's log (stdout and ``study.log`` in the output folder) and its one-line errors."""

from __future__ import annotations

import time
from pathlib import Path

_LOG_FILES: list[Path] = []
_MUTED = [False]


class StudyError(ValueError):
    """A user-facing failure: one ``error:`` line, exit status 2."""


def set_log_file(path: Path | None) -> None:
    """Every :func:`log` line also goes to ``path`` (None: stdout only)."""
    _LOG_FILES[:] = [path] if path is not None else []


def log_file() -> Path | None:
    """The file :func:`log` writes to besides stdout (None: none)."""
    return _LOG_FILES[0] if _LOG_FILES else None


def mute() -> None:
    """No :func:`log` line from this process (a run's rank other than 0: rank 0 says it)."""
    _MUTED[0] = True
    _LOG_FILES.clear()


def log(msg: str) -> None:
    if _MUTED[0]:
        return
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    for path in _LOG_FILES:
        with open(path, "a") as f:
            f.write(line + "\n")
