"""User errors in data, the ``on_error: skip`` report, and rank-0-only reporting.

A :class:`DataError` is a ``ValueError``: the entry points print it as one line and exit
with status 2 (:func:`bebop_megatron.cli.run_cli`). Errors about one input line read
``PATH:LINE: what is wrong``.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections import Counter


class DataError(ValueError):
    """Bad training data or a data/tokenizer/model mismatch; the message is one line."""


class DataWarning(UserWarning):
    """A summary of data that was skipped, dropped or truncated (never per line)."""


class LineError(Exception):
    """One bad input line: ``reason`` is the counting key, ``message`` says what is wrong."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = " ".join(message.split())  # one line, whatever the source said


def malformed_json(err: json.JSONDecodeError) -> str:
    """``malformed JSON: WHAT at column N`` for one JSONL line: ``N`` counts from the line's start
    (the decoder counts the line's own newline as a line 2 and would say 'line 2 column 1')."""
    end = len(err.doc.rstrip("\r\n"))  # the decoder skips the newline as whitespace, then fails past it
    if err.pos >= end:
        return f"malformed JSON: {err.msg} at column {end + 1} (the end of the line)"
    return f"malformed JSON: {err.msg} at column {err.pos + 1}"


def is_rank0() -> bool:
    """True without torch.distributed, or on global rank 0."""
    dist = sys.modules.get("torch.distributed")
    return dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0


def log_rank0(message: str) -> None:
    """Default ``log`` of the data builders: stderr, rank 0 only."""
    if is_rank0():
        print(message, file=sys.stderr, flush=True)


def warn_rank0(message: str) -> None:
    if is_rank0():
        warnings.warn(message, DataWarning, stacklevel=3)


class SkipReport:
    """Counts skipped lines per reason (with the first line of each) for one file."""

    def __init__(self, path: str, unit: str = "line"):
        self.path, self.unit = path, unit
        self.counts: Counter[str] = Counter()
        self.first_line: dict[str, int] = {}

    def add(self, reason: str, line: int) -> None:
        self.counts[reason] += 1
        self.first_line.setdefault(reason, line)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self, num_lines: int) -> str:
        parts = ", ".join(
            f"{n} {reason} (first: {self.unit} {self.first_line[reason]})" for reason, n in sorted(self.counts.items())
        )
        return f"{self.path}: skipped {self.total} of {num_lines} {self.unit}s (data.on_error=skip): {parts}"
