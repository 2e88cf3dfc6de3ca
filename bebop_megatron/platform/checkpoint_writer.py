"""Redirection of Megatron-Core's checkpoint writer: keep the OSError and file of a failed write.

Reason: Megatron-Core 0.19 reports a failed shard write only by its type, so "No space left on
device" and the file name were lost (see ``bebop_megatron.training.write_errors``).
"""

from __future__ import annotations

failed_writes: list[OSError] = []  # this process's failed shard writes, with their file names


def record_write_errors() -> None:
    """Keep the ``OSError`` and the file of a failed shard write (idempotent).

    Megatron-Core 0.19's ``FileSystemWriterAsync.write_preloaded_data`` catches the error, and
    the code above it reports only its type ("error: <class 'OSError'>"), so "No space left on
    device" and the file name were lost. This wrapper records the error with its file for
    :func:`bebop_megatron.training.write_errors.write_problem`, and from the main writer (no results queue) raises it again: Megatron
    keeps the text of what it raises there, which also reaches the trainer from the forked
    writer of ``save.async_save``.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.write_preloaded_data
    if getattr(original, "records_errors", False):
        return

    def write_preloaded_data(transform_list, local_proc_idx, write_bucket, *args, **kwargs):
        output = original(transform_list, local_proc_idx, write_bucket, *args, **kwargs)
        if output is not None and isinstance(output[1], OSError):
            err = output[1]
            located = err if err.filename else OSError(err.errno, err.strerror, str(write_bucket[0]))
            failed_writes.append(located)
            if kwargs.get("results_queue", args[0] if args else None) is None:
                raise located
        return output

    write_preloaded_data.records_errors = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)
