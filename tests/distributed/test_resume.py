"""Checkpoints: resume reproduces the uninterrupted run; a checkpoint loads at another layout."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.launch import run_script

BASE = [
    "device=cpu", "train.micro_batch_size=2", "train.global_batch_size=4", "train.seq_length=32",
    "model.num_layers=4", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=200",
    "train.lr=3e-3", "train.warmup_fraction=0.25", "train.lr_schedule=cosine", "train.steps=4",
]


def train(tmp_path, name: str, overrides: list[str], save_model=None) -> list[dict]:
    out = tmp_path / f"{name}.json"
    args = ["--out", str(out)] + (["--save-model", str(save_model)] if save_model else [])
    run_script("train_and_record.py", args + BASE + overrides, nproc=2)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    init = tmp / "init"
    full = train(tmp, "full", ["parallel.tensor=2", "save.dir=null"], save_model=init)
    weights = f"model.init_checkpoint={init}"
    # A run that saves every 2 steps and "crashes" after the step-2 checkpoint: its step-4
    # checkpoint is removed and `latest` points back at step 2. Then it is resumed.
    first = train(tmp, "first", ["parallel.tensor=2", f"save.dir={tmp / 'ckpt'}", "save.interval=2", weights])
    shutil.rmtree(tmp / "ckpt" / "iter_0000004")
    (tmp / "ckpt" / "latest").write_text("iter_0000002")
    shutil.copytree(tmp / "ckpt", tmp / "ckpt_pp")
    resumed = train(tmp, "resumed", ["parallel.tensor=2", f"save.dir={tmp / 'ckpt'}", weights])
    # The same checkpoint resumed under pipeline parallelism instead of tensor parallelism.
    resumed_pp = train(tmp, "resumed_pp", ["parallel.pipeline=2", f"save.dir={tmp / 'ckpt_pp'}", weights])
    return {"full": full, "first": first, "resumed": resumed, "resumed_pp": resumed_pp, "tmp": tmp}


def test_resume_reproduces_uninterrupted_losses(runs):
    full, first, resumed = runs["full"], runs["first"], runs["resumed"]
    assert [m["loss"] for m in first] == [m["loss"] for m in full]  # saving changes nothing
    assert [m["step"] for m in resumed] == [3, 4]  # continues at the next step, next samples
    # Same layout, MTP weights + Adam state + LR schedule + data position restored: exact.
    assert [m["loss"] for m in resumed] == [m["loss"] for m in full[2:]]


def test_resume_at_another_layout(runs):
    full, resumed_pp = runs["full"], runs["resumed_pp"]
    assert [m["step"] for m in resumed_pp] == [3, 4]
    for got, want in zip(resumed_pp, full[2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_latest_points_at_complete_checkpoint(runs):
    ckpt = runs["tmp"] / "ckpt"
    assert (ckpt / "latest").read_text() == "iter_0000004"
    assert (ckpt / "iter_0000004" / "metadata.json").exists()
    assert not list(ckpt.glob("*.tmp"))


@pytest.fixture(scope="module")
def distributed_optimizer_runs(runs):
    """parallel.distributed_optimizer=true at DP=2: a run saving every 2 steps, its step-2
    checkpoint resumed at DP=2 and at TP=2 (the fully reshardable optimizer format)."""
    tmp, dist_opt = runs["tmp"], ["parallel.distributed_optimizer=true"]
    first = train(tmp, "dopt_first", dist_opt + [f"save.dir={tmp / 'dopt'}", "save.interval=2"])
    shutil.rmtree(tmp / "dopt" / "iter_0000004")
    (tmp / "dopt" / "latest").write_text("iter_0000002")
    shutil.copytree(tmp / "dopt", tmp / "dopt_tp")
    resumed = train(tmp, "dopt_resumed", dist_opt + [f"save.dir={tmp / 'dopt'}"])
    resumed_tp = train(tmp, "dopt_resumed_tp", dist_opt + ["parallel.tensor=2", f"save.dir={tmp / 'dopt_tp'}"])
    return first, resumed, resumed_tp


def test_distributed_optimizer_checkpoint_resumes_exactly(runs, distributed_optimizer_runs):
    first, resumed, resumed_tp = distributed_optimizer_runs
    # The uninterrupted DP=2 run equals the TP=2 reference run (another layout, same math).
    for got, want in zip(first, runs["full"]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert [m["step"] for m in resumed] == [3, 4]
    # Adam's moments and per-parameter step restored: the same layout continues bit-exactly
    # (a shared `step` tensor once made step 4 differ), another layout within rounding.
    assert [m["loss"] for m in resumed] == [m["loss"] for m in first[2:]]
    for got, want in zip(resumed_tp, first[2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
