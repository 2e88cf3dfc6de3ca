"""Parquet training data (issue 39 item 2): the text and token-id layouts as columns, read one
row group at a time, in weighted mixtures with JSONL, through tools/preprocess_data.py, and one
error line for a file without known columns, a corrupt footer or a missing pyarrow."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from bebop_megatron.config import load_config
from bebop_megatron.data import ByteTokenizer, DataError, build_train_dataset
from bebop_megatron.data.jsonl import read_jsonl
from tests.helpers.data import write_jsonl

pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install -e '.[test]' brings it)")
import pyarrow as pa  # noqa: E402

RECORDS = [
    {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i} " * (i % 3 + 1)}]}
    for i in range(4)
] + [{"prompt": f"q{i}", "response": f"answer {i}"} for i in range(3)] + [{"text": "plain text"}] + [
    {"input_ids": [257, 10, 11, 12, 258], "loss_mask": [0, 0, 1, 1, 1]},
    {"prompt_ids": [257, 20], "response_ids": [21, 22, 258], "logprobs": [-0.1, -0.2, -0.3]},
]


def write_parquet(path, records, row_group_size: int = 3):
    """One column per key of any record (null where a record lacks it)."""
    keys = list(dict.fromkeys(k for rec in records for k in rec))
    pq.write_table(pa.table({k: [rec.get(k) for rec in records] for k in keys}), str(path),
                   row_group_size=row_group_size)
    return path


def same_documents(a, b) -> bool:
    return (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.trained, b.trained)
            and np.array_equal(a.offsets, b.offsets))


def test_parquet_rows_read_as_the_jsonl_lines(tmp_path):
    # One table with every layout: a row's other columns are null (left out).
    parquet = write_parquet(tmp_path / "mixed.parquet", RECORDS)
    jsonl = write_jsonl(tmp_path / "mixed.jsonl", RECORDS)
    got = read_jsonl(str(parquet), ByteTokenizer(), progress=False)
    want = read_jsonl(str(jsonl), ByteTokenizer(), progress=False)
    assert len(got) == len(RECORDS) and same_documents(got, want)
    # A file named otherwise is recognised by its magic bytes.
    renamed = tmp_path / "mixed.data"
    renamed.write_bytes(parquet.read_bytes())
    assert same_documents(read_jsonl(str(renamed), ByteTokenizer(), progress=False), want)


def test_row_groups_are_read_one_at_a_time(tmp_path, monkeypatch):
    from bebop_megatron.data import records

    path = write_parquet(tmp_path / "groups.parquet", RECORDS, row_group_size=2)
    assert pq.ParquetFile(str(path)).num_row_groups == 5
    reads = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, *a, **k: reads.append(i) or original(self, i, *a, **k))
    rows = records.iter_parquet(str(path))
    assert next(rows) == RECORDS[0] and reads == [0]
    next(rows)
    assert reads == [0]
    next(rows)
    assert reads == [0, 1]
    assert len(list(rows)) == len(RECORDS) - 3 and reads == [0, 1, 2, 3, 4]


def test_weighted_mixture_of_parquet_and_jsonl(tmp_path):
    a = [{"prompt": f"a{i}", "response": "yes " * (i + 1)} for i in range(6)]
    b = [{"text": f"b text {i}"} for i in range(3)]
    write_parquet(tmp_path / "a.parquet", a)
    write_jsonl(tmp_path / "a.jsonl", a)
    write_jsonl(tmp_path / "b.jsonl", b)

    def rows(first: str):
        files = f"[{{path: {tmp_path / first}, weight: 3}}, {{path: {tmp_path / 'b.jsonl'}, weight: 1}}]"
        cfg = load_config(None, [f"data.train_files={files}", "train.seq_length=16", "data.seed=3"])
        ds = build_train_dataset(cfg, log=lambda _: None, progress=False)
        return ds, [ds.row(i) for i in range(3 * len(ds))]

    (ds, got), (_, want) = rows("a.parquet"), rows("a.jsonl")
    assert list(ds.counts) == [7, 2]  # 9 documents split 3:1
    for x, y in zip(got, want):
        assert all(np.array_equal(x[k], y[k]) for k in x)


def test_preprocess_accepts_parquet(tmp_path):
    from bebop_megatron.data.indexed import IndexedSource
    from bebop_megatron.data.preprocess import preprocess

    parquet = write_parquet(tmp_path / "in.parquet", RECORDS)
    meta = preprocess([str(parquet)], str(tmp_path / "ds" / "train"), log=lambda _: None, progress=False)
    want = read_jsonl(str(write_jsonl(tmp_path / "in.jsonl", RECORDS)), ByteTokenizer(), progress=False)
    source = IndexedSource(str(tmp_path / "ds" / "train"))
    assert meta["num_documents"] == len(source) == len(want)
    for j in range(len(want)):
        tokens, trained = source.get(j)
        assert np.array_equal(tokens, want.get(j)[0]) and np.array_equal(trained, want.get(j)[1])


def test_parquet_without_known_columns_is_one_line(tmp_path):
    path = write_parquet(tmp_path / "odd.parquet", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError) as err:
        read_jsonl(str(path), ByteTokenizer(), progress=False)
    assert str(err.value) == (f"{path}: no column of a known layout (columns: question, answer); expected messages, "
                              "prompt/response, text, input_ids, prompt_ids/response_ids, input/output or tokens")


def test_corrupt_parquet_footer_is_one_line(tmp_path):
    good = write_parquet(tmp_path / "good.parquet", RECORDS).read_bytes()
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(good[:-12] + b"\x00" * 8 + good[-4:])  # footer length and metadata destroyed, magic kept
    with pytest.raises(DataError) as err:
        read_jsonl(str(path), ByteTokenizer(), progress=False)
    assert str(err.value).startswith(f"{path}: not a readable Parquet file: ") and "\n" not in str(err.value)


def test_bad_parquet_row_names_the_row(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [{"input_ids": [1, 2, 3]}, {"input_ids": [1, 600]}])
    with pytest.raises(DataError, match=rf"^{path}: row 1: input_ids\[1\]=600 is out of range"):
        read_jsonl(str(path), ByteTokenizer(), progress=False, vocab_size=512)


def test_missing_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "x.parquet", RECORDS)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
    with pytest.raises(DataError) as err:
        read_jsonl(str(path), ByteTokenizer(), progress=False)
    assert str(err.value).endswith("pip install 'bebop_megatron[parquet]' (or pip install pyarrow)")
    assert "\n" not in str(err.value)
