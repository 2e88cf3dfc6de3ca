"""The study's log (stdout and ``study.log`` in the output folder) and its one-line errors."""

from __future__ import annotations

import errno
import time
from pathlib import Path

_LOG_FILES: list[Path] = []
_MUTED = [False]


class StudyError(ValueError):
    """A user-facing failure: one ``error:`` line, exit status 2."""


class StudyDiskError(RuntimeError):
    """The disk failed the study (no space left, quota, an I/O error): one ``error:`` line, exit
    status 74 as the trainer's (:class:`bebop_megatron.training.write_errors.CheckpointWriteError`).
    Said once for the process: :func:`bebop_megatron.cli.run_cli` closes its process groups first."""

    exit_code = 74
    same_on_every_rank = True


DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded", errno.EIO: "I/O error"}
# What a write may meet besides the disk's own failures: the user's choice of place (exit 2).
WRITE_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EEXIST}


def write_error(err: OSError, what: str) -> Exception:
    """One line for ``err``, met while ``what`` wrote: a :class:`StudyDiskError` (exit 74) when the
    disk failed, else a :class:`StudyError` (exit 2: a read-only file system, permissions, a file
    where a folder should be)."""
    where = err.filename or what
    if err.errno in DISK_ERRNOS:
        return StudyDiskError(f"{what}: {DISK_ERRNOS[err.errno]} while writing {where}")
    return StudyError(f"{what}: cannot write {where} ({err.strerror or err})")


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
