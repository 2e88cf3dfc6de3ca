"""Preemption and run outputs: SIGTERM mid-run gives a complete checkpoint and exit status 75.

Two CPU ranks started as srun would (one process each), saving every step asynchronously
and keeping the last 2 checkpoints. SIGTERM goes to rank 1 only: the ranks agree on it at the
next step, publish that step's checkpoint, and both exit with the requeue code. The same run
writes TensorBoard events and an offline wandb run, prints its resolved config and MFU, and
only rank 0 prints.

A second run gets SIGTERM the way srun, scancel and torchrun send it: to every process of the
job, so also each rank's forked checkpoint writer and the process that relays the writers'
results (it used to die of it, and the final save ended in BrokenPipeError with a ``.tmp``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.production import output, read_stream, start_ranks, wait_all, wait_for_step

TINY = [
    "device=cpu", "parallel.tensor=2", "train.micro_batch_size=2", "train.global_batch_size=4",
    "train.seq_length=32", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.vocab_size=200",
]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preempt")
    stream = tmp / "steps.jsonl"
    args = [
        *TINY, "train.steps=200", f"save.dir={tmp / 'ckpt'}", "save.interval=1",
        "save.keep_last=2", "save.async_save=true",
        f"logging.tensorboard_dir={tmp / 'tb'}", "logging.wandb.mode=offline", f"logging.wandb.dir={tmp}",
        "logging.wandb.project=bebop-test", "logging.wandb.name=preempt-run", "logging.peak_tflops=0.05",
    ]
    procs = start_ranks(stream, args, nproc=2)
    wait_for_step(stream, 2, procs)
    procs[1].send_signal(signal.SIGTERM)
    codes = wait_all(procs)
    return {"tmp": tmp, "codes": codes, "rows": read_stream(stream), "out": [output(stream, r) for r in (0, 1)]}


def test_sigterm_saves_a_complete_checkpoint_and_exits_with_the_requeue_code(preempted):
    from bebop_megatron.training.signals import REQUEUE_EXIT_CODE

    assert preempted["codes"] == [REQUEUE_EXIT_CODE, REQUEUE_EXIT_CODE], preempted["out"][0][1][-3000:]
    last = preempted["rows"][-1]["step"]
    assert 2 <= last < 200
    ckpt = preempted["tmp"] / "ckpt"
    assert (ckpt / "latest").read_text() == f"iter_{last:07d}"  # the step both ranks stopped after
    for name in ("metadata.json", "config.yaml", "__0_0.distcp", "__1_0.distcp"):
        assert (ckpt / f"iter_{last:07d}" / name).exists(), name
    assert not list(ckpt.glob("*.tmp"))
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [f"iter_{last - 1:07d}", f"iter_{last:07d}"]  # keep_last=2
    from bebop_megatron.training.checkpoint import read_common_state

    common = read_common_state(str(ckpt / f"iter_{last:07d}"))
    assert common["step"] == last and common["consumed_samples"] == 4 * last
    stdout = preempted["out"][0][0]
    assert f"at step {last}; exiting with {REQUEUE_EXIT_CODE} so that the launcher requeues the job" in stdout
    assert "Traceback" not in preempted["out"][0][1] + preempted["out"][1][1]


def test_only_rank_0_prints_the_config_and_progress(preempted):
    (stdout0, _), (stdout1, _) = preempted["out"]
    assert stdout1.strip() == ""
    assert stdout0.startswith("resolved config:\n")
    assert "max_skipped_steps: 10" in stdout0 and "recipe: delayed" in stdout0
    steps = [line for line in stdout0.splitlines() if line.startswith("step ")]
    assert len(steps) == len(preempted["rows"])
    assert all(" MFU " in line and " GiB " in line and " tok/s " in line and "alpha_RS [" in line for line in steps)


def test_tensorboard_events_are_written(preempted):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(preempted["tmp"] / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for tag in ("train/loss", "perf/mfu", "perf/peak_memory_gib", "mtp/alpha_rs_step1", "mtp/alpha_rs_step3"):
        assert tag in scalars, tag
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"])) for r in preempted["rows"]]


def test_wandb_offline_writes_a_run_directory(preempted):
    runs = list((preempted["tmp"] / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((preempted["tmp"] / "wandb").iterdir())
    assert list(runs[0].glob("run-*.wandb"))  # the run's history, for `wandb sync`
    # the run id is kept in save.dir, so a requeued job logs into the same wandb run
    run_id = (preempted["tmp"] / "ckpt" / "wandb_run_id").read_text().strip()
    assert runs[0].name.endswith(f"-{run_id}"), runs[0].name


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_process_group_with_async_save(tmp_path):
    from bebop_megatron.training.signals import REQUEUE_EXIT_CODE

    stream, ckpt = tmp_path / "steps.jsonl", tmp_path / "ckpt"
    args = [*TINY, "train.steps=200", f"save.dir={ckpt}", "save.interval=1", "save.async_save=true"]
    procs = start_ranks(stream, args, nproc=2, process_group=True)
    pgid = procs[0].pid
    try:
        wait_for_step(stream, 2, procs)
        os.killpg(pgid, signal.SIGTERM)
        codes = wait_all(procs)
        deadline = time.monotonic() + 10  # helper processes leave with their rank
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(pgid), "processes of the job are still running after both ranks exited"
    finally:
        if _group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
    (_, err0), (_, err1) = output(stream, 0), output(stream, 1)
    assert codes == [REQUEUE_EXIT_CODE, REQUEUE_EXIT_CODE], err0[-3000:] + err1[-3000:]
    assert "Traceback" not in err0 + err1 and "BrokenPipeError" not in err0 + err1, err0[-3000:]
    last = read_stream(stream)[-1]["step"]
    assert (ckpt / "latest").read_text() == f"iter_{last:07d}"
    for name in ("metadata.json", ".metadata", "config.yaml", "__0_0.distcp", "__1_0.distcp"):
        assert (ckpt / f"iter_{last:07d}" / name).exists(), name
    assert not list(ckpt.glob("*.tmp"))
