"""``sbatch slurm/train_tv.sbatch`` under a real one-node Slurm (``tests/helpers/slurm_cluster.py``):
two CPU ranks of ``examples/configs/tiny_cpu.yaml`` made tinier, submitted as docs/production.md
says, on this host as the node.

- to completion: exit status 0, the checkpoints in ``CKPT_DIR``, the console in ``<job name>-<id>.out``;
- ``scancel --signal=USR1 --batch`` (what ``--signal=B:USR1@300`` sends before the time limit):
  torchrun passes USR1 on to the ranks (no rank sees its launcher die), they save at the next
  step and exit 75, the script requeues the job (``Restarts=1``), the restart resumes from
  ``latest`` and its losses are the uninterrupted run's, bit for bit;
- ``scancel`` (TERM), sent to that restart once it has trained two steps (one job start fewer,
  ~12 s of CPU): a checkpoint at the next step, no further requeue, ``CANCELLED`` with exit status 1;
- a config error: its ``error:`` line in the job's output once, no requeue, ``FAILED``.

The losses come from ``logging.metrics_file`` (appended across the requeue). Signals are sent
two steps into a run of 20: the ranks agree on them at the next step boundaries, long before the end.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from bebop_megatron.config import load_config
from tests.helpers.launch import REPO, _free_port

SBATCH = REPO / "slurm" / "train_tv.sbatch"
CONFIG = "examples/configs/tiny_cpu.yaml"
STEPS, SAVE_INTERVAL = 20, 10
TINY = [
    "model.backbone_init=random", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.vocab_size=200", "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4",
    f"train.steps={STEPS}", f"save.interval={SAVE_INTERVAL}",
]
JOB_TIMEOUT = 180
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def submit(cluster, tmp: Path, *overrides: str) -> int:
    """``sbatch`` as a user on one CPU node would: 2 ranks (``GPUS_PER_NODE=2``), no GPUs."""
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # torchrun of this environment
        "PYTHONPATH": str(REPO), "GPUS_PER_NODE": "2", "CKPT_DIR": str(tmp / "ckpt"),
        "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
    }
    return cluster.sbatch("--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={tmp}/%x-%j.out",
                          str(SBATCH), CONFIG, *TINY, f"logging.metrics_file={tmp / 'metrics.jsonl'}", *overrides,
                          env=env, cwd=REPO)


def losses(tmp: Path) -> list[tuple[int, float]]:
    path = tmp / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    rows = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]  # complete lines
    return [(row["step"], row["train/loss"]) for row in rows]


def wait_until(cluster, job_id: int, tmp: Path, ready, what: str) -> None:
    """Until ``ready()`` (polled every 0.1 s); fails once the job has ended (its state polled every second)."""
    deadline, polls = time.monotonic() + JOB_TIMEOUT, 0
    while not ready():
        if polls % 10 == 0:
            state = cluster.job(job_id)["JobState"]
            assert state not in ENDED, f"job {job_id} {state} before {what}: {console(tmp, job_id)[-3000:]}"
        assert time.monotonic() < deadline, f"{what} not reached in {JOB_TIMEOUT}s"
        polls += 1
        time.sleep(0.1)


def wait_for_step(cluster, job_id: int, tmp: Path, step: int) -> None:
    """Until rank 0 has logged ``step``."""
    wait_until(cluster, job_id, tmp, lambda: any(s >= step for s, _ in losses(tmp)), f"step {step}")


def finished(cluster, job_id: int) -> dict:
    """Wait until the job has ended and left the queue; its ``scontrol show job`` fields."""
    return cluster.wait_job(job_id, lambda f: f["JobState"] in ENDED and str(job_id) not in cluster.squeue(),
                            JOB_TIMEOUT, "the end")


def outcome(fields: dict) -> tuple[str, str, str]:
    return fields["JobState"], fields["ExitCode"], fields["Restarts"]


def console(tmp: Path, job_id: int) -> str:
    return (tmp / f"bebop-mtp-{job_id}.out").read_text()


def checkpoints(tmp: Path) -> tuple[str, list[str]]:
    ckpt = tmp / "ckpt"
    return (ckpt / "latest").read_text().strip(), sorted(p.name for p in ckpt.glob("iter_*"))


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job_id = submit(slurm_cluster, tmp)
    return tmp, job_id, finished(slurm_cluster, job_id)


def test_a_job_runs_to_completion(uninterrupted):
    tmp, job_id, fields = uninterrupted
    out = console(tmp, job_id)
    assert outcome(fields) == ("COMPLETED", "0:0", "0"), out[-3000:]
    assert out.startswith(f"job {job_id} (restart 0): 1 nodes x 2 GPUs, rendezvous ")
    assert f"checkpoints {tmp / 'ckpt'}\n" in out
    assert f"step    {STEPS}/{STEPS} | " in out and "requeueing" not in out
    assert checkpoints(tmp) == (f"iter_{STEPS:07d}", [f"iter_{SAVE_INTERVAL:07d}", f"iter_{STEPS:07d}"])
    assert [s for s, _ in losses(tmp)] == list(range(1, STEPS + 1))


@pytest.fixture(scope="module")
def preempted(slurm_cluster, tmp_path_factory):
    """USR1 two steps in; once the restart has trained two steps, scancel (TERM)."""
    tmp = tmp_path_factory.mktemp("preempted")
    job_id = submit(slurm_cluster, tmp)
    wait_for_step(slurm_cluster, job_id, tmp, 2)
    usr1 = slurm_cluster.run("scancel", "--signal=USR1", "--batch", str(job_id))
    assert usr1.returncode == 0, usr1.stderr
    resumed = re.compile(r"^resumed from \S+ at step (\d+) ", re.M)
    wait_until(slurm_cluster, job_id, tmp, lambda: resumed.search(console(tmp, job_id)), "the restart")
    step = int(resumed.search(console(tmp, job_id))[1])
    wait_for_step(slurm_cluster, job_id, tmp, step + 2)  # the first run stopped at ``step``: the restart's
    term = slurm_cluster.run("scancel", str(job_id))
    assert term.returncode == 0, term.stderr
    fields = finished(slurm_cluster, job_id)
    return tmp, job_id, fields, console(tmp, job_id)


def test_usr1_checkpoints_requeues_and_resumes_with_the_uninterrupted_losses(preempted, uninterrupted):
    tmp, job_id, fields, out = preempted
    ckpt = tmp / "ckpt"
    stopped = re.search(rf"^SIGUSR1: checkpoint {ckpt}/iter_(\d+) at step (\d+); exiting with 75 so that the "
                        r"launcher requeues the job$", out, re.M)
    assert stopped, out[-3000:]
    step = int(stopped[2])
    assert 2 < step < STEPS and int(stopped[1]) == step  # at the next step boundary
    # the documented path: the trap, srun, torchrun passing USR1 on to both ranks, the requeue
    assert out.count("USR1: the ranks save a checkpoint, then the job is requeued\n") == 1
    assert len(re.findall(r"Sending process \d+ closing signal SIGUSR1", out)) == 2
    assert "is gone" not in out and "User defined signal" not in out
    assert f"requeueing job {job_id} (srun exit 1); it resumes from {ckpt}/latest\n" in out
    assert fields["Restarts"] == "1" and f"job {job_id} (restart 1): " in out
    assert f"resumed from {ckpt}/iter_{step:07d} at step {step} " in out
    # every step once, across the two runs, with the uninterrupted run's losses
    resumed = losses(tmp)
    assert len(resumed) >= step + 2 and resumed == losses(uninterrupted[0])[:len(resumed)]


def test_scancel_checkpoints_and_is_not_requeued(preempted):
    tmp, job_id, fields, out = preempted
    # the script exits with srun's status (torchrun reports the ranks' 75 as 1); Restarts: the USR1's
    assert outcome(fields) == ("CANCELLED", "1:0", "1"), out[-3000:]
    ckpt = tmp / "ckpt"
    stopped = re.search(rf"^SIGTERM: checkpoint {ckpt}/iter_(\d+) at step (\d+); exiting with 75", out, re.M)
    assert stopped, out[-3000:]
    step = int(stopped[2])
    assert int(stopped[1]) == step and [s for s, _ in losses(tmp)][-1] == step
    first = int(re.search(r"^resumed from \S+ at step (\d+) ", out, re.M)[1])  # the USR1's checkpoint
    saved = sorted({f"iter_{s:07d}" for s in (first, SAVE_INTERVAL, step) if s <= step})
    assert checkpoints(tmp) == (f"iter_{step:07d}", saved)
    assert out.split(f"job {job_id} (restart 1): ")[1].count("TERM: the ranks save a checkpoint and stop\n") == 1
    assert len(re.findall(r"Sending process \d+ closing signal SIGTERM", out)) == 2
    assert out.count("requeueing") == 1 and "is gone" not in out


def test_a_config_error_is_one_line_and_not_requeued(slurm_cluster, tmp_path):
    job_id = submit(slurm_cluster, tmp_path, "train.stepz=3")
    fields = finished(slurm_cluster, job_id)
    out = console(tmp_path, job_id)
    assert outcome(fields) == ("FAILED", "1:0", "0"), out[-3000:]
    with pytest.raises(ValueError) as err:  # what the config check says, without Slurm
        load_config(str(REPO / CONFIG), ["train.stepz=3"])
    assert str(err.value).startswith("unknown config key 'train.stepz'")
    assert [line for line in out.splitlines() if line.startswith("error:")] == [f"error: {err.value}"]
    assert "requeueing" not in out and not (tmp_path / "ckpt").exists()
