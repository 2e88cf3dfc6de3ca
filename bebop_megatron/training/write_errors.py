"""A checkpoint that cannot be written: one line on every rank, ``latest`` untouched, exit 74.

Megatron's writers (threads, or a forked process with ``save.async_save``) report a failed
write through torch's ``CheckpointException``, with the details on the coordinating rank
only, and ``write()`` raises an ``OSError`` without a path. After a save every rank calls
:func:`raise_agreed_write_error`, so that all of them stop with the same message, e.g.
``no space left on device while writing save_dir/iter_0000004.tmp/__0_0.distcp``.
"""

from __future__ import annotations

import errno
import re
import shutil

import torch.distributed as dist

from bebop_megatron.platform.checkpoint_writer import failed_writes as _failed_writes

CHECKPOINT_WRITE_EXIT_CODE = 74
"""Exit status when a checkpoint cannot be written (``EX_IOERR``)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, permissions); ``latest`` still names
    the previous complete checkpoint. Agreed by every rank; the CLI exits with 74."""

    exit_code = CHECKPOINT_WRITE_EXIT_CODE
    same_on_every_rank = True


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:']+?): '([^']+)'")


def _walk(obj, seen: set | None = None):
    """``obj`` and every exception inside it: causes, contexts, arguments and torch's
    ``CheckpointException.failures`` (rank -> (exception, traceback))."""
    seen = set() if seen is None else seen
    if obj is None or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, BaseException):
        yield obj
        children = [getattr(obj, "failures", None), obj.__cause__, obj.__context__, *obj.args]
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    else:
        return
    for child in children:
        yield from _walk(child, seen)


def _os_error_in(err: BaseException | None) -> OSError | None:
    for exc in _walk(err):
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        match = _ERRNO_TEXT.search(str(exc))  # an OSError turned into text by Megatron
        if match:
            return OSError(int(match.group(1)), match.group(2), match.group(3))
    return None


def write_problem(err: BaseException | None, where: str) -> str | None:
    """One line for a filesystem error of this process's save (None when there is none)."""
    recorded, _failed_writes[:] = list(_failed_writes), []
    os_err = recorded[0] if recorded else _os_error_in(err)
    if os_err is None:
        return None
    path = os_err.filename or where
    if os_err.errno == errno.ENOSPC:
        return f"no space left on device while writing {path}"
    if os_err.errno == errno.EDQUOT:
        return f"disk quota exceeded while writing {path}"
    return f"cannot write checkpoint {path}: {os_err.strerror or os_err}"


def raise_agreed_write_error(failure: BaseException | None, where: str) -> None:
    """Collective after a save: if any rank failed, every rank raises the same
    :class:`CheckpointWriteError` line (a filesystem error where one is known; rank 0 removes
    the partial ``.tmp``). A failure that is no write failure (not torch's
    ``CheckpointException``) is re-raised where it happened."""
    # failed_writes: also rank 0's own writes, recorded (not raised) under deferred_coordinator_errors
    mine = None if failure is None and not _failed_writes else (write_problem(failure, where) or "")
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, mine)
    if all(p is None for p in problems):
        return
    described = next((p for p in problems if p), None)
    if described is None and failure is not None and not hasattr(failure, "failures"):
        raise failure
    if dist.get_rank() == 0 and where.endswith(".tmp"):
        shutil.rmtree(where, ignore_errors=True)  # free the space; `latest` is untouched
    if described is None:
        reason = next((str(e).strip().splitlines()[0] for e in _walk(failure) if not hasattr(e, "failures")
                       and str(e).strip()), "see the other ranks' errors")
        failed = [r for r, p in enumerate(problems) if p is not None]
        described = f"saving {where} failed on rank(s) {failed}: {reason[:300]}"
    raise CheckpointWriteError(described)
