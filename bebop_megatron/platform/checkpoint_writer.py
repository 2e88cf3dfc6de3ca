"""Redirection of Megatron-Core's checkpoint writer: keep the OSError and file of a failed write.

Reason: Megatron-Core 0.19 reports a failed shard write only by its type, so "No space left on
device" and the file name were lost (see ``bebop_megatron.training.write_errors``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import traceback

failed_writes: list[OSError] = []  # this process's failed shard writes, with their file names
_defer_coordinator_errors = False


@contextlib.contextmanager
def deferred_coordinator_errors():
    """While active, an ``OSError`` of the writes rank 0 makes alone (``.metadata``,
    ``metadata.json``) is recorded in :data:`failed_writes` instead of raised.

    Reason: raised there (a full disk), it made rank 0 skip the collective that follows those
    writes on every other rank (a broadcast, a barrier) and enter the next one instead; gloo's
    mismatched collectives then crashed it (SIGSEGV, ``run.lock`` left behind). The caller agrees
    on :data:`failed_writes` after the save
    (:func:`bebop_megatron.training.write_errors.raise_agreed_write_error`).
    """
    global _defer_coordinator_errors
    previous, _defer_coordinator_errors = _defer_coordinator_errors, True
    try:
        yield
    finally:
        _defer_coordinator_errors = previous


FULL_BELOW = 1 << 20
"""A filesystem with less free space than this (bytes) is taken as full when a write failed
without an ``OSError``."""


def filesystem_full(path: str) -> bool:
    """Whether the filesystem holding ``path`` (or its nearest existing parent) has less than
    :data:`FULL_BELOW` bytes free for unprivileged writers."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        stat = os.statvfs(path)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < FULL_BELOW


def _deferring(original, file_of):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except OSError as err:
            if not _defer_coordinator_errors:
                raise
            failed_writes.append(err if err.filename else OSError(err.errno, err.strerror, file_of(*args, **kwargs)))

    wrapper.records_errors = True
    return wrapper


def record_write_errors() -> None:
    """Keep the ``OSError`` and the file of a failed shard write (idempotent).

    Megatron-Core 0.19's ``FileSystemWriterAsync.write_preloaded_data`` catches the error, and
    the code above it reports only its type ("error: <class 'OSError'>"), so "No space left on
    device" and the file name were lost. This wrapper records the error with its file for
    :func:`bebop_megatron.training.write_errors.write_problem`, and from the main writer (no results queue) raises it again: Megatron
    keeps the text of what it raises there, which also reaches the trainer from the forked
    writer of ``save.async_save``.
    """
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    # Rank 0's own writes: recorded under deferred_coordinator_errors (see there).
    if not getattr(FileSystemWriterAsync.finish, "records_errors", False):
        FileSystemWriterAsync.finish = _deferring(
            FileSystemWriterAsync.finish, lambda writer, *a, **k: os.path.join(str(writer.checkpoint_dir), ".metadata"))
    if not getattr(serialization.save_config, "records_errors", False):
        serialization.save_config = _deferring(
            serialization.save_config,
            lambda config, checkpoint_dir, *a, **k: os.path.join(str(checkpoint_dir), "metadata.json"))
    original = FileSystemWriterAsync.write_preloaded_data
    if getattr(original, "records_errors", False):
        return

    def write_preloaded_data(transform_list, local_proc_idx, write_bucket, *args, **kwargs):
        output = original(transform_list, local_proc_idx, write_bucket, *args, **kwargs)
        if output is not None and isinstance(output[1], BaseException):
            traceback.clear_frames(output[1].__traceback__)  # see _free_failed_write's locals
        if output is not None and isinstance(output[1], Exception) and not isinstance(output[1], OSError) \
                and filesystem_full(str(write_bucket[0])):
            # torch.save's zip writer turns a short write into "[enforce fail at inline_container.cc]
            # unexpected pos N vs M" (a RuntimeError): a full disk, said so.
            output = (output[0], OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(write_bucket[0])))
        if output is not None and isinstance(output[1], OSError):
            err = output[1]
            located = err if err.filename else OSError(err.errno, err.strerror, str(write_bucket[0]))
            failed_writes.append(located)
            if kwargs.get("results_queue", args[0] if args else None) is None:
                raise located
        return output

    write_preloaded_data.records_errors = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)
