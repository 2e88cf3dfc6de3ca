"""Indexed datasets: tools/preprocess_data.py round trip, same rows as JSONL, mismatch errors."""

from __future__ import annotations

import importlib.util
import json
import warnings

import numpy as np
import pytest

from bebop_megatron.config import ConfigError, load_config
from bebop_megatron.data import DataError, DataWarning, HFTokenizer, build_train_dataset, build_valid_dataset
from bebop_megatron.data.indexed import IndexedSource
from bebop_megatron.data.jsonl import read_jsonl
from tests.helpers.data import write_jsonl
from tests.helpers.launch import REPO

CHAT = [{"role": "user", "content": "tell me a story"}, {"role": "assistant", "content": "once upon a time"},
        {"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}]


def _tool():
    spec = importlib.util.spec_from_file_location("preprocess_data", REPO / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _corpus(tmp_path):
    rng = np.random.default_rng(0)
    words = "hello world how are you the cat sat on mat good night".split()
    a = [{"messages": CHAT}] + [{"prompt": " ".join(rng.choice(words, rng.integers(1, 6))),
                                 "response": " ".join(rng.choice(words, rng.integers(1, 9)))} for _ in range(25)]
    b = [{"text": " ".join(rng.choice(words, rng.integers(1, 30)))} for _ in range(15)]
    return write_jsonl(tmp_path / "a.jsonl", a), write_jsonl(tmp_path / "b.jsonl", b)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        return fn(*args, log=lambda s: None, progress=False, **kwargs)


def test_round_trip_same_documents_and_rows(tmp_path, hf_dir):
    a, b = _corpus(tmp_path)
    prefix = tmp_path / "out" / "train"
    _tool().main(["--input", str(a), str(b), "--output-prefix", str(prefix), "--tokenizer", str(hf_dir),
                  "--no-progress"])
    meta = json.loads((tmp_path / "out" / "train_meta.json").read_text())
    tok = HFTokenizer(str(hf_dir))
    assert meta["vocab_size"] == tok.vocab_size and meta["eos_id"] == tok.eos_id and meta["pad_id"] == tok.pad_id
    assert meta["num_documents"] == 41 and meta["train_on"] == "response"
    assert not list((tmp_path / "out").glob("*.partial*"))

    # The stored tokens and masks are exactly the JSONL documents, in input order.
    src = IndexedSource(str(prefix))
    assert src.tokens[0].dtype == np.uint16  # a small vocabulary
    docs = [_quiet(read_jsonl, str(p), tok) for p in (a, b)]
    expected = [d.get(j) for d in docs for j in range(len(d))]
    assert len(src) == len(expected) and meta["num_tokens"] == int(np.sum(src.lengths))
    for j, (tokens, trained) in enumerate(expected):
        got_tokens, got_trained = src.get(j)
        assert got_tokens.tolist() == tokens.tolist() and got_trained.tolist() == trained.tolist()

    # The packed rows of the JSONL files and of the indexed dataset are identical, train and valid,
    # whatever spelling of the prefix and with a blend.
    common = [f"data.tokenizer={hf_dir}", "train.seq_length=24", "data.seed=3"]
    for jsonl_files, indexed_files in [
        (f"[{a},{b}]", f"[{prefix}]"),
        (f"[{{path: {a}, weight: 2}}, {{path: {b}, weight: 1}}]", None),
    ]:
        if indexed_files is None:  # a blend of two indexed datasets written separately
            for name, path in (("pa", a), ("pb", b)):
                _tool().main(["--input", str(path), "--output-prefix", str(tmp_path / name), "--tokenizer",
                              str(hf_dir), "--no-progress"])
            indexed_files = f"[{{path: {tmp_path / 'pa'}.bin, weight: 2}}, {{path: {tmp_path / 'pb'}.idx, weight: 1}}]"
        for build in (build_train_dataset, build_valid_dataset):
            cfg_j = load_config(None, [f"data.train_files={jsonl_files}", f"data.valid_files={jsonl_files}", *common])
            cfg_i = load_config(None, [f"data.train_files={indexed_files}", f"data.valid_files={indexed_files}", *common])
            ds_j, ds_i = _quiet(build, cfg_j), _quiet(build, cfg_i)
            assert len(ds_j) == len(ds_i) > 5
            for i in range(2 * len(ds_j) + 1):
                rj, ri = ds_j.row(i), ds_i.row(i)
                for key in rj:
                    assert np.array_equal(rj[key], ri[key]) and rj[key].dtype == ri[key].dtype, (i, key)


def test_train_on_all_and_mismatches(tmp_path, hf_dir):
    a, _ = _corpus(tmp_path)
    _tool().main(["--input", str(a), "--output-prefix", str(tmp_path / "hf"), "--tokenizer", str(hf_dir), "--no-progress"])
    _tool().main(["--input", str(a), "--output-prefix", str(tmp_path / "all"), "--tokenizer", str(hf_dir),
                  "--train-on", "all", "--no-progress"])
    base = [f"data.tokenizer={hf_dir}", "train.seq_length=24"]
    # train_on=all over a response mask: every token trained, same tokens.
    resp = _quiet(build_train_dataset, load_config(None, [f"data.train_files=[{tmp_path / 'hf'}]", *base]))
    every = _quiet(build_train_dataset, load_config(None, [f"data.train_files=[{tmp_path / 'hf'}]",
                                                           "data.train_on=all", *base]))
    r, e = resp.row(0), every.row(0)
    assert np.array_equal(r["tokens"], e["tokens"]) and e["loss_mask"].sum() > r["loss_mask"].sum()
    assert np.array_equal(e["loss_mask"], (e["labels"] != resp.pad_id).astype(np.float32))
    # A response mask cannot be recovered from an --train-on all dataset.
    with pytest.raises(DataError, match=r"stores the mask of --train-on all"):
        _quiet(build_train_dataset, load_config(None, [f"data.train_files=[{tmp_path / 'all'}]", *base]))
    # The run's tokenizer must be the one the dataset was written with (here: the byte default).
    with pytest.raises(DataError, match=r"data.train_files\[0\]: .* was tokenized with .* but this run uses the built-in byte"):
        _quiet(build_train_dataset, load_config(None, [f"data.train_files=[{tmp_path / 'hf'}]", "train.seq_length=24"]))
    # A missing loss mask is named.
    (tmp_path / "hf_lossmask.idx").unlink()
    with pytest.raises(DataError, match=r"hf_lossmask.idx is missing"):
        _quiet(build_train_dataset, load_config(None, [f"data.train_files=[{tmp_path / 'hf'}]", *base]))


def test_synthetic_default_and_no_valid(tmp_path):
    cfg = load_config(None, ["train.seq_length=8", "data.num_samples=5"])
    ds = build_train_dataset(cfg)
    assert type(ds).__name__ == "MarkovDataset" and len(ds) == 5
    assert build_valid_dataset(cfg) is None
    row = ds.row(7)  # wraps around
    assert np.array_equal(row["tokens"], ds[2][:-1]) and row["loss_mask"].tolist() == [1.0] * 8


def test_bad_line_after_good_ones_leaves_no_output_and_skip_records_counts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}] * 3 + ['{"text": 1}', {"text": "fine"}])
    with pytest.raises(DataError, match=rf"^{path}:4: field 'text' must be a string, got number$"):
        _tool().main(["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--no-progress"])
    assert not list(tmp_path.glob("out*"))
    with pytest.warns(DataWarning, match="skipped 1 of 5 lines"):
        _tool().main(["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--on-error", "skip",
                      "--no-progress"])
    meta = json.loads((tmp_path / "out_meta.json").read_text())
    assert meta["num_documents"] == 4 and meta["inputs"][0]["skipped"] == {"wrong type": 1}
    assert sorted(p.name for p in tmp_path.glob("out*")) == [
        "out.bin", "out.idx", "out_lossmask.bin", "out_lossmask.idx", "out_meta.json"]


def test_an_existing_dataset_is_replaced_only_with_overwrite(tmp_path):
    """Rewriting a prefix used to be silent: a run resuming on it went on with other data."""
    first = write_jsonl(tmp_path / "first.jsonl", [{"text": "one"}] * 3)
    second = write_jsonl(tmp_path / "second.jsonl", [{"text": "two"}] * 5)
    prefix = tmp_path / "data" / "train"
    _tool().main(["--input", str(first), "--output-prefix", str(prefix), "--no-progress"])
    before = {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir()}
    with pytest.raises(DataError) as err:
        _tool().main(["--input", str(second), "--output-prefix", str(prefix), "--no-progress"])
    assert str(err.value) == (f"--output-prefix {prefix}: {prefix}.bin already exists (a dataset written earlier); "
                              "pass --overwrite to replace it, or choose another prefix")
    assert {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir()} == before
    (tmp_path / "data" / "train.bin").unlink()  # any file of the dataset counts
    with pytest.raises(DataError, match=rf"^--output-prefix {prefix}: {prefix}.idx already exists"):
        _tool().main(["--input", str(second), "--output-prefix", str(prefix), "--no-progress"])
    _tool().main(["--input", str(second), "--output-prefix", str(prefix), "--overwrite", "--no-progress"])
    assert json.loads((tmp_path / "data" / "train_meta.json").read_text())["num_documents"] == 5

def test_a_missing_or_truncated_file_is_named_before_the_model(tmp_path):
    """(issue 26 item 19) One half of the pair: the missing file; a truncated .bin or .idx: named
    when the dataset is opened (it used to fail at the first read, after the model build)."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello world"}, {"prompt": "a", "response": "bcd"}])
    prefix = tmp_path / "d"
    _tool().main(["--input", str(path), "--output-prefix", str(prefix), "--no-progress"])
    overrides = [f"data.train_files=[{prefix}]", "train.seq_length=8"]
    for ext, other in ((".idx", ".bin"), (".bin", ".idx")):
        moved = tmp_path / f"moved{ext}"
        (tmp_path / f"d{ext}").rename(moved)
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert str(err.value) == (f"data.train_files[0]={str(prefix)!r}: indexed dataset file {f'{prefix}{ext}'!r} "
                                  f"not found ({prefix}{other} is there)")
        moved.rename(tmp_path / f"d{ext}")
    for ext, message in ((".bin", f"{prefix}.bin is truncated (20 bytes; its .idx needs 38)"),
                         (".idx", f"{prefix}.idx is truncated or not a Megatron index")):
        whole = (tmp_path / f"d{ext}").read_bytes()
        (tmp_path / f"d{ext}").write_bytes(whole[:20] if ext == ".bin" else whole[:-8])
        with pytest.raises(DataError) as err:
            _quiet(build_train_dataset, load_config(None, overrides))
        assert str(err.value) == f"data.train_files[0]: {message}; re-run tools/preprocess_data.py"
        (tmp_path / f"d{ext}").write_bytes(whole)
    assert len(_quiet(build_train_dataset, load_config(None, overrides))) == 2
