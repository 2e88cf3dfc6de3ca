"""Ctrl-C (SIGINT) saves as SIGTERM does: a complete checkpoint at the next step boundary, one line
saying so, exit status 130; the resumed run's losses are the uninterrupted run's, bit for bit.

- in a single process (the terminal's SIGINT reaches the trainer itself): it used to exit 130
  with no line and an empty ``save.dir``;
- under torchrun (2 CPU ranks, gloo, DP=2): the terminal's SIGINT reaches torchrun only (its
  ranks run in sessions of their own), which forwards it to every rank and waits for them
  (``--shutdown-timeout``) before it exits 1 with its own report; the ranks used to die of
  ``KeyboardInterrupt`` with no checkpoint and no line, losing every step.

Each run trains at a constant LR without warmup, so that its losses do not depend on
``train.steps``: the interrupted run is long, the reference and the resumed run end 2 steps
after the interrupted run's checkpoint.
"""

from __future__ import annotations

import signal
import time

from tests.helpers.launch import REPO, start_torchrun
from tests.helpers.production import output, read_stream, run_ranks, start_ranks, wait_all, wait_for_step

SCRIPT = REPO / "tests" / "helpers" / "production_run.py"
TINY = [
    "device=cpu", "train.micro_batch_size=2", "train.global_batch_size=4", "train.seq_length=32",
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=200",
    "train.lr=3e-3", "train.warmup_fraction=0", "train.lr_schedule=constant",
]
LONG = "train.steps=100000"


def losses(stream) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_stream(stream)}


def latest_step(ckpt) -> int:
    return int((ckpt / "latest").read_text().removeprefix("iter_"))


def check_resume_reproduces(tmp_path, ckpt, interrupted: dict[int, float], nproc: int) -> None:
    """The checkpoint is the interrupted run's last step; resuming from it for 2 more steps gives
    the losses of a run that was never interrupted."""
    j = latest_step(ckpt)
    assert j == max(interrupted) >= 2
    assert not list(ckpt.glob("*.tmp")) and not (ckpt / "run.lock").exists()
    for name in ("metadata.json", ".metadata", "config.yaml"):
        assert (ckpt / f"iter_{j:07d}" / name).exists(), name
    steps = f"train.steps={j + 2}"
    assert run_ranks(tmp_path / "full.jsonl", [*TINY, steps, "save.dir=null"], nproc=nproc) == [0] * nproc
    assert run_ranks(tmp_path / "resumed.jsonl", [*TINY, steps, f"save.dir={ckpt}"], nproc=nproc) == [0] * nproc
    full, resumed = losses(tmp_path / "full.jsonl"), losses(tmp_path / "resumed.jsonl")
    assert interrupted == {s: full[s] for s in interrupted}
    assert sorted(resumed) == [j + 1, j + 2]
    assert resumed == {s: full[s] for s in resumed}  # bit-exact continuation


def test_ctrl_c_in_a_single_process_saves_and_exits_130(tmp_path):
    stream, ckpt = tmp_path / "interrupted.jsonl", tmp_path / "ckpt"
    procs = start_ranks(stream, [*TINY, LONG, f"save.dir={ckpt}"], nproc=1)
    wait_for_step(stream, 2, procs)
    procs[0].send_signal(signal.SIGINT)
    codes = wait_all(procs)
    stdout, stderr = output(stream, 0)
    assert codes == [130], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    j = latest_step(ckpt)
    assert stderr.splitlines().count(
        "Ctrl-C: saving a checkpoint when this training step ends, then exiting with 130 (Ctrl-C again stops "
        "at once, without it)") == 1
    assert stdout.strip().splitlines()[-1] == (
        f"SIGINT (Ctrl-C): checkpoint {ckpt}/iter_{j:07d} at step {j}; exiting with 130 "
        "(train.resume=auto continues from it)")
    check_resume_reproduces(tmp_path, ckpt, losses(stream), nproc=1)


def test_ctrl_c_under_torchrun_saves_on_every_rank(tmp_path):
    stream, ckpt = tmp_path / "interrupted.jsonl", tmp_path / "ckpt"
    torchrun = start_torchrun(SCRIPT, ["--stream", str(stream), *TINY, LONG, f"save.dir={ckpt}"], tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not (read_stream(stream) and read_stream(stream)[-1]["step"] >= 2):
            assert torchrun.poll() is None, (tmp_path / "err").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step 2 within 240 s"
            time.sleep(0.05)
        torchrun.send_signal(signal.SIGINT)  # what the terminal's Ctrl-C sends: torchrun alone
        code = torchrun.wait(timeout=120)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert code == 1, stderr[-3000:]  # torchrun's own status after a signal (its SignalException)
    assert "SignalException" in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "Unable to shutdown process" not in stderr, stderr[-3000:]  # the ranks exited before its timeout
    j = latest_step(ckpt)
    assert f"SIGINT (Ctrl-C): checkpoint {ckpt}/iter_{j:07d} at step {j}; exiting with 130" in stdout, stdout[-3000:]
    assert stderr.count("Ctrl-C: saving a checkpoint when this training step ends") == 1  # rank 0's line only
    for rank in (0, 1):
        assert (ckpt / f"iter_{j:07d}" / f"__{rank}_0.distcp").exists()
    check_resume_reproduces(tmp_path, ckpt, losses(stream), nproc=2)


def test_the_stop_lines_without_save_dir(tmp_path):
    """save.dir=null: the lines say that nothing is saved; nothing is left behind in the working directory."""
    stream = tmp_path / "interrupted.jsonl"
    procs = start_ranks(stream, [*TINY, LONG, "save.dir=null"], nproc=1)
    wait_for_step(stream, 1, procs)
    procs[0].send_signal(signal.SIGINT)
    codes = wait_all(procs)
    stdout, stderr = output(stream, 0)
    assert codes == [130], stderr[-3000:]
    assert "Ctrl-C: stopping (save.dir is null: no checkpoint) when this training step ends" in stderr
    last = max(losses(stream))
    assert stdout.strip().splitlines()[-1] == f"SIGINT (Ctrl-C): checkpoint (none: save.dir is null) at step {last}; " \
        "exiting with 130"
