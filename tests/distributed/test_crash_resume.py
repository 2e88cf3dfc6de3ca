"""Crash safety: kill -9 at a random step, a crash inside a save, and resume at TP=2 from TP=1.

Two CPU ranks started as srun would (one process each, tests/helpers/production.py), DP=2,
checkpoints every step:

- ``full``: 6 uninterrupted steps, the reference;
- ``killed``: ``kill -9`` of both ranks right after a random step (its checkpoint may be half
  written); ``latest`` names the last complete checkpoint, step j;
- ``resumed``: continues from step j at the same layout (losses bit-identical to ``full``)
  and dies by SIGKILL in the middle of writing its second checkpoint (step j+2): ``latest``
  must still name step j+1;
- ``resumed_tp2``: loads that step-(j+1) checkpoint at TP=2 and finishes the run with the
  reference losses (within float tolerance: another layout sums in another order).
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from tests.helpers.production import output, read_stream, run_ranks, start_ranks, wait_all, wait_for_step

BASE = [
    "device=cpu", "train.micro_batch_size=2", "train.global_batch_size=4", "train.seq_length=32",
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=200",
    "train.lr=3e-3", "train.warmup_fraction=0.25", "train.lr_schedule=cosine", "train.steps=6",
]
SEED = int(os.environ.get("BEBOP_KILL_SEED", random.randrange(1000)))  # printed on failure


def losses(rows):
    return {r["step"]: r["loss"] for r in rows}


def latest(ckpt) -> int:
    return int((ckpt / "latest").read_text().removeprefix("iter_"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crash")
    ckpt, init = tmp / "ckpt", tmp / "init"
    assert run_ranks(tmp / "full.jsonl", ["--save-model", str(init), *BASE, "save.dir=null"], nproc=2) == [0, 0]
    common = [*BASE, f"model.init_checkpoint={init}", f"save.dir={ckpt}"]

    kill_at = random.Random(SEED).randint(2, 3)
    procs = start_ranks(tmp / "killed.jsonl", [*common, "save.interval=1"], nproc=2)
    wait_for_step(tmp / "killed.jsonl", kill_at, procs)
    for proc in procs:
        os.kill(proc.pid, signal.SIGKILL)
    killed_codes = wait_all(procs)
    after_kill = latest(ckpt)

    resumed_codes = run_ranks(tmp / "resumed.jsonl", ["--crash-in-save", "2", *common, "save.interval=1"], nproc=2)
    after_crash = latest(ckpt)
    partial = sorted(p.name for p in ckpt.glob("*.tmp"))

    tp2_codes = run_ranks(tmp / "resumed_tp2.jsonl", [*common, "parallel.tensor=2"], nproc=2)
    assert tp2_codes == [0, 0], output(tmp / "resumed_tp2.jsonl", 0)[1][-3000:]
    return {
        "ckpt": ckpt, "kill_at": kill_at, "killed_codes": killed_codes, "after_kill": after_kill,
        "resumed_codes": resumed_codes, "after_crash": after_crash, "partial": partial,
        **{name: losses(read_stream(tmp / f"{name}.jsonl")) for name in ("full", "killed", "resumed", "resumed_tp2")},
    }


def test_kill_9_at_a_random_step_then_resume_reproduces_the_losses_exactly(runs):
    full, killed, resumed, j = runs["full"], runs["killed"], runs["resumed"], runs["after_kill"]
    assert runs["killed_codes"] == [-9, -9]
    assert runs["kill_at"] - 1 <= j <= max(killed), f"seed {SEED}"  # the last complete checkpoint
    assert {s: full[s] for s in killed} == killed  # checkpointing every step changes nothing
    assert sorted(resumed) == [j + 1, j + 2], f"seed {SEED}"
    assert {s: full[s] for s in resumed} == resumed, f"seed {SEED}"  # bit-exact continuation


def test_crash_during_save_leaves_previous_checkpoint_as_latest(runs):
    j = runs["after_kill"]
    assert runs["resumed_codes"] == [-9, -9]
    assert runs["after_crash"] == j + 1  # not the half-written step j+2
    assert runs["partial"] == [f"iter_{j + 2:07d}.tmp"]
    # that checkpoint loads (next test) and carries the resolved config of the run
    assert "max_skipped_steps" in (runs["ckpt"] / f"iter_{j + 1:07d}" / "config.yaml").read_text()


def test_resume_at_tp2_from_a_tp1_checkpoint(runs):
    full, resumed, j = runs["full"], runs["resumed_tp2"], runs["after_crash"]
    assert sorted(resumed) == list(range(j + 1, 7))
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], rel=1e-5), step
    assert latest(runs["ckpt"]) == 6
    assert not list(runs["ckpt"].glob("*.tmp"))  # the crashed run's partial save is cleaned up
