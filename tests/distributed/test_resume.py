"""Checkpoints: resume reproduces the uninterrupted run; a checkpoint loads at another layout
(TP, PP, context parallelism in both directions, the distributed optimizer)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import run_script

BASE = [
    "device=cpu", "train.micro_batch_size=2", "train.global_batch_size=4", "train.seq_length=32",
    "model.num_layers=4", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=200",
    "train.lr=3e-3", "train.warmup_fraction=0.25", "train.lr_schedule=cosine", "train.steps=4",
]


def train_all(tmp, runs: list[tuple[str, list[str], dict]]) -> dict[str, list[dict]]:
    """``(name, overrides, options)`` runs, one after the other in one 2-rank launch
    (tests/helpers/train_and_record.py --cases: each a new Trainer, as a new job would be);
    options: ``save_model`` (write the initial model there), ``before`` (file operations first)."""
    cases = [{"out": str(tmp / f"{name}.json"), "overrides": BASE + overrides, **options}
             for name, overrides, options in runs]
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases, default=str))
    run_script("train_and_record.py", ["--cases", str(spec)], nproc=2, timeout=900)
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name, _, _ in runs}


def crash_after_step_2(ckpt) -> list:
    """The run "crashed" after its step-2 checkpoint: the step-4 one is removed and ``latest``
    points back at step 2."""
    return [["rmtree", ckpt / "iter_0000004"], ["write", ckpt / "latest", "iter_0000002"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    init, ckpt, dopt, cpck = tmp / "init", tmp / "ckpt", tmp / "dopt", tmp / "ckpt_c2"
    weights = f"model.init_checkpoint={init}"
    # parallel.distributed_optimizer=true at DP=2: a run saving every 2 steps, its step-2
    # checkpoint resumed at DP=2 and at TP=2 (the fully reshardable optimizer format).
    dist_opt = ["parallel.distributed_optimizer=true"]
    return {"tmp": tmp, **train_all(tmp, [
        ("full", ["parallel.tensor=2", "save.dir=null"], {"save_model": init}),
        # A run that saves every 2 steps and "crashes" after the step-2 checkpoint; then resumed.
        ("first", ["parallel.tensor=2", f"save.dir={ckpt}", "save.interval=2", weights], {}),
        ("resumed", ["parallel.tensor=2", f"save.dir={ckpt}", weights],
         {"before": crash_after_step_2(ckpt) + [["copytree", ckpt, tmp / "ckpt_pp"],
                                                 ["copytree", ckpt, tmp / "ckpt_cp"]]}),
        # The same checkpoint resumed under pipeline parallelism instead of tensor parallelism,
        # and under context parallelism (C=2).
        ("resumed_pp", ["parallel.pipeline=2", f"save.dir={tmp / 'ckpt_pp'}", weights], {}),
        ("resumed_cp", ["parallel.context=2", f"save.dir={tmp / 'ckpt_cp'}", weights], {}),
        # The other way: a run at C=2 that "crashes" after its step-2 checkpoint, resumed at C=1 (DP=2).
        ("cp_first", ["parallel.context=2", f"save.dir={cpck}", "save.interval=2", weights], {}),
        ("cp_resumed_c1", [f"save.dir={cpck}", weights], {"before": crash_after_step_2(cpck)}),
        ("dopt_first", dist_opt + [f"save.dir={dopt}", "save.interval=2"], {}),
        ("dopt_resumed", dist_opt + [f"save.dir={dopt}"],
         {"before": crash_after_step_2(dopt) + [["copytree", dopt, tmp / "dopt_tp"]]}),
        ("dopt_resumed_tp", dist_opt + ["parallel.tensor=2", f"save.dir={tmp / 'dopt_tp'}"], {}),
    ])}


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


def test_resume_across_a_change_of_context_parallel_size(runs):
    """A TP=2 checkpoint resumes at C=2, and a C=2 checkpoint at C=1, with the uninterrupted
    run's losses (the checkpoint holds whole rows' worth of state: nothing depends on C)."""
    full = runs["full"]
    for got, want in zip(runs["cp_first"], full):  # C=2 trains as TP=2 does
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    for name in ("resumed_cp", "cp_resumed_c1"):
        assert [m["step"] for m in runs[name]] == [3, 4], name
        for got, want in zip(runs[name], full[2:]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), name


def test_latest_points_at_complete_checkpoint(runs):
    ckpt = runs["tmp"] / "ckpt"
    assert (ckpt / "latest").read_text() == "iter_0000004"
    assert (ckpt / "iter_0000004" / "metadata.json").exists()
    assert not list(ckpt.glob("*.tmp"))


def test_distributed_optimizer_checkpoint_resumes_exactly(runs):
    first, resumed, resumed_tp = runs["dopt_first"], runs["dopt_resumed"], runs["dopt_resumed_tp"]
    # The uninterrupted DP=2 run equals the TP=2 reference run (another layout, same math).
    for got, want in zip(first, runs["full"]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert [m["step"] for m in resumed] == [3, 4]
    # Adam's moments and per-parameter step restored: the same layout continues bit-exactly
    # (a shared `step` tensor once made step 4 differ), another layout within rounding.
    assert [m["loss"] for m in resumed] == [m["loss"] for m in first[2:]]
    for got, want in zip(resumed_tp, first[2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
