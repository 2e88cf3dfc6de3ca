"""The entry points' outputs, checked before any work and written as one line on failure: valid
JSON (:func:`write_json`), an output directory or file that can be written, and the one-line error
of a write the file system refused (:func:`output_write_error`: exit 74 for a full disk or quota,
as a checkpoint's). Low in the package (no import of it): the data layer's writers use it too.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf: a statistic with nothing to measure)
    replaced by None, recursively through dicts, lists and tuples."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path: str, obj: Any, indent: int = 1) -> None:
    """Write ``obj`` as valid JSON: non-finite floats become ``null`` (:func:`finite`; bare
    ``NaN`` is not JSON), anything else that JSON cannot hold raises. Every tool's JSON output."""
    with open(path, "w") as f:
        json.dump(finite(obj), f, indent=indent, allow_nan=False)


def check_output_file(path: str, flag: str) -> None:
    """Before any work: ``path`` can be written as a file (its directory exists; it is not a
    directory itself)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist; create it first")


OUTPUT_WRITE_EXIT_CODE = 74
"""Exit status when an output cannot be written for want of space (``EX_IOERR``), as a checkpoint."""


class OutputWriteError(RuntimeError):
    """An output file could not be written: no space left on device or quota exceeded (exit 74)."""

    exit_code = OUTPUT_WRITE_EXIT_CODE


def output_write_error(err: OSError, flag: str, path: str, then: str = "") -> Exception:
    """The one-line error for ``err``, raised while writing ``path`` (the output ``flag`` names;
    ``then``: what follows, e.g. how to resume): :class:`OutputWriteError` (exit 74) for a full
    disk or quota, else a ``ValueError`` (exit 2: a read-only file system, permissions)."""
    import errno

    where, then = err.filename or path, f"; {then}" if then else ""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if err.errno == errno.ENOSPC else "disk quota exceeded"
        return OutputWriteError(f"{flag} {path}: {what} while writing {where}{then}")
    return ValueError(f"{flag} {path} cannot be written ({err.strerror or err}: {where}){then}")


def check_output_dir(path: str, flag: str) -> None:
    """Before any work: ``path`` is a directory or can be created as one (neither it nor a
    directory above it is an existing file)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "" if probe == os.path.abspath(path) else f": {probe}"
        raise ValueError(f"{flag} {path}{where} exists and is not a directory")
