"""bebop_megatron.platform.atomic: a file is replaced whole or left as it was."""

import json
import os

import numpy as np
import pytest

from bebop_megatron.platform import atomic
from bebop_megatron.platform.atomic import atomic_open, write_atomic


def test_write_atomic_text_and_bytes(tmp_path):
    write_atomic(tmp_path / "sub" / "a.txt", "héllo\n")
    assert (tmp_path / "sub" / "a.txt").read_bytes() == "héllo\n".encode("utf-8")
    write_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    write_atomic(str(tmp_path / "b.bin"), b"\x02")
    assert (tmp_path / "b.bin").read_bytes() == b"\x02"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.txt", "b.bin", "sub"]


def test_an_exception_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old\n")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_open(path) as f:
            f.write("half of the new")
            raise RuntimeError("disk full")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_fsync_before_the_rename(tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: order.append("fsync"))
    real_replace = os.replace
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: (order.append("replace"), real_replace(a, b)))
    write_atomic(tmp_path / "x", "1")
    assert order == ["fsync", "replace"]
    order.clear()
    write_atomic(tmp_path / "x", "2", fsync=False)
    assert order == ["replace"] and (tmp_path / "x").read_text() == "2"


def test_only_write_modes(tmp_path):
    with pytest.raises(ValueError, match="mode 'a'"):
        with atomic_open(tmp_path / "x", "a"):
            pass


def test_study_writers_leave_no_partial_file(tmp_path, monkeypatch):
    """The study's record and rows: a value that cannot be written keeps the previous file."""
    from bebop_megatron.study.runs import load_rows, save_rows, write_json

    record = tmp_path / "record.json"
    write_json(record, {"a": 1.0, "b": float("nan")})
    assert json.loads(record.read_text()) == {"a": 1.0, "b": None}
    with pytest.raises(TypeError):
        write_json(record, {"a": object()})
    assert json.loads(record.read_text()) == {"a": 1.0, "b": None}

    rows = tmp_path / "rows.npz"
    save_rows(rows, {"1": {"text": [1, 2], "chain": [True, False]}})
    with pytest.raises(ValueError):
        save_rows(rows, {"1": {"text": ["not", "ints"]}})

    def disk_full(f, **arrays):
        f.write(b"PK\x03\x04 half an archive")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez_compressed", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_rows(rows, {"1": {"text": [3], "chain": [True]}})
    monkeypatch.undo()
    got = load_rows(rows)["1"]
    np.testing.assert_array_equal(got["text"], [1, 2])
    np.testing.assert_array_equal(got["chain"], [True, False])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "rows.npz"]
