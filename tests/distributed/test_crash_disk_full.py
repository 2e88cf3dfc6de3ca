"""Resume after ``latest`` was lost, with a new learning rate, then a full disk while saving.

CPU ranks started as srun would (one process each, tests/helpers/production.py):

- ``first``: one rank, 2 steps, a checkpoint after each; then ``latest`` is deleted;
- ``second``: two ranks (DP=2), ``train.steps=4 train.lr=2e-3``: it must resume from iter_2 (the newest complete
  checkpoint, said in one line; it used to start again at step 1) with the new LR from step 3 on
  (it used to fail with Megatron's "Could not find parameter group"), save iter_3, and at its
  second save rank 0's shard writes fail with ENOSPC (tests/helpers/production_run.py
  ``--disk-full-in-save``): every rank stops with exit status 74, rank 0 prints one line
  naming the file, ``latest`` still names iter_3 and the partial iter_4.tmp is removed;
- ``async``: the same with ``save.async_save=true``, where the shards are written by a forked
  process and the failure surfaces at the next step's check.
"""

from __future__ import annotations

import pytest

from tests.helpers.production import output, read_stream, run_ranks

BASE = [
    "device=cpu", "train.micro_batch_size=2", "train.global_batch_size=4", "train.seq_length=32",
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=200",
    "train.warmup_fraction=0", "save.interval=1",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disk_full")
    ckpt = tmp / "ckpt"
    common = [*BASE, f"save.dir={ckpt}"]
    first = run_ranks(tmp / "first.jsonl", [*common, "train.steps=2"], nproc=1)
    assert first == [0], output(tmp / "first.jsonl", 0)[1][-3000:]
    (ckpt / "latest").unlink()
    codes = run_ranks(tmp / "second.jsonl", ["--disk-full-in-save", "2", *common, "train.steps=4", "train.lr=2e-3"],
                      nproc=2)
    async_codes = run_ranks(tmp / "async.jsonl", ["--disk-full-in-save", "1", *common, "train.steps=5",
                                                  "train.lr=2e-3", "save.async_save=true"], nproc=2)
    return {"ckpt": ckpt, "codes": codes, "rows": read_stream(tmp / "second.jsonl"),
            "out": [output(tmp / "second.jsonl", r) for r in (0, 1)],
            "async_codes": async_codes, "async_out": [output(tmp / "async.jsonl", r) for r in (0, 1)]}


def test_a_lost_latest_resumes_from_the_newest_complete_checkpoint_with_the_new_lr(runs):
    ckpt, (stdout, _) = runs["ckpt"], runs["out"][0]
    assert [r["step"] for r in runs["rows"]] == [3, 4]  # not step 1 again
    assert (f"{ckpt / 'latest'} is missing: resuming from the newest complete checkpoint {ckpt / 'iter_0000002'}"
            in stdout)
    assert (f"resuming from {ckpt / 'iter_0000002'} with changed settings: train.lr 0.001 -> 0.002, train.steps 2 -> 4 "
            "(the LR schedule is rebuilt from the new values and applies from step 3)") in stdout
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(" lr 2.00e-03 " in line for line in steps), steps


def test_disk_full_while_saving_is_one_line_keeps_latest_and_exits_74(runs):
    ckpt, (_, stderr0), (_, stderr1) = runs["ckpt"], runs["out"][0], runs["out"][1]
    assert runs["codes"] == [74, 74], stderr0[-3000:]
    errors = [line for line in stderr0.splitlines() if line.startswith("error:")]
    assert errors == [f"error: no space left on device while writing {ckpt / 'iter_0000004.tmp' / '__0_0.distcp'}"]
    assert not [line for line in stderr1.splitlines() if line.startswith("error:")]  # agreed: rank 0 reports it
    assert "Traceback" not in stderr0 + stderr1
    assert (ckpt / "latest").read_text() == "iter_0000003"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]


def test_disk_full_in_the_async_writer_is_the_same_line(runs):
    ckpt, (_, stderr0), (_, stderr1) = runs["ckpt"], *runs["async_out"]
    assert runs["async_codes"] == [74, 74], stderr0[-3000:]
    errors = [line for line in stderr0.splitlines() if line.startswith("error:")]
    assert errors == [f"error: no space left on device while writing {ckpt / 'iter_0000004.tmp' / '__0_0.distcp'}"]
    assert not [line for line in stderr1.splitlines() if line.startswith("error:")]
    assert "Traceback" not in stderr0 + stderr1
    assert (ckpt / "latest").read_text() == "iter_0000003" and not list(ckpt.glob("*.tmp"))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_in_rank0s_own_metadata_write_exits_74_on_every_rank(tmp_path, async_save):
    """Issue 36 item 2: the shards fit, then rank 0's ``.metadata`` write (rank 0 alone writes it)
    fails. Raised there, it skipped the broadcast the other rank waits in: rank 0 died of SIGSEGV
    and left ``run.lock``. Now every rank exits 74 with the one line naming the file."""
    ckpt = tmp_path / "ckpt"
    codes = run_ranks(tmp_path / "meta.jsonl", ["--disk-full-in-metadata", "1", *BASE, f"save.dir={ckpt}",
                                                "train.steps=2", f"save.async_save={str(async_save).lower()}"],
                      nproc=2)
    (_, stderr0), (_, stderr1) = output(tmp_path / "meta.jsonl", 0), output(tmp_path / "meta.jsonl", 1)
    assert codes == [74, 74], stderr0[-3000:] + stderr1[-3000:]
    errors = [line for line in stderr0.splitlines() if line.startswith("error:")]
    assert errors == [f"error: no space left on device while writing {ckpt / 'iter_0000001.tmp' / '.metadata'}"]
    assert not [line for line in stderr1.splitlines() if line.startswith("error:")]
    assert "Traceback" not in stderr0 + stderr1
    assert sorted(p.name for p in ckpt.iterdir()) == []  # no run.lock, no partial iter_0000001.tmp, no latest
