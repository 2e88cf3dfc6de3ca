"""``tools/generate_responses.py`` run in-process (``run_cli`` around its ``main``, as its
``__main__`` does), shared by tests/test_generate_responses*.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from bebop_megatron.cli import run_cli
from tests.helpers.launch import REPO

TOOL_PATH = REPO / "tools" / "generate_responses.py"
_spec = importlib.util.spec_from_file_location("generate_responses_tool", TOOL_PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def run_tool(capsys, *args) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one in-process run."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: sys.exit(tool.main([str(a) for a in args])))
    out = capsys.readouterr()
    return exit_info.value.code or 0, out.out, out.err


def read_out(path: Path) -> dict:
    """(id, sample) -> output record; asserts every line is complete and no key repeats."""
    data = path.read_bytes()
    assert data.endswith(b"\n")
    records = [json.loads(line) for line in data.splitlines()]
    keyed = {(json.dumps(r["id"]), r["sample"]): r for r in records}
    assert len(keyed) == len(records), "a sample was written twice"
    return keyed


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]



def interrupted_copy(full: Path, partial: Path, num_lines: int, cut: int) -> list[bytes]:
    """``partial`` as an interrupted run writing ``full`` leaves it: its first ``num_lines``
    lines, ``cut`` bytes of the next one, the same settings record. Returns ``full``'s lines."""
    lines = full.read_bytes().splitlines(keepends=True)
    partial.write_bytes(b"".join(lines[:num_lines]) + lines[num_lines][:cut])
    shutil.copy(f"{full}.settings.json", f"{partial}.settings.json")
    return lines
