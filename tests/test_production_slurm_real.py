"""``sbatch slurm/train_tv.sbatch`` under a real Slurm (``tests/helpers/slurm_cluster.py``): two CPU
ranks of ``examples/configs/tiny_cpu.yaml`` made tinier, submitted as docs/production.md says.

On one node (this host):

- to completion: exit status 0, the checkpoints in ``CKPT_DIR``, the console in ``<job name>-<id>.out``;
- ``scancel --signal=USR1 --batch`` (what ``--signal=B:USR1@300`` sends before the time limit):
  torchrun passes USR1 on to the ranks (no rank sees its launcher die), they save at the next
  step and exit 75, the script requeues the job (``Restarts=1``), the restart resumes from
  ``latest`` and its losses are the uninterrupted run's, bit for bit;
- ``scancel`` (TERM), sent to that restart once it has trained two steps (one job start fewer,
  ~12 s of CPU): a checkpoint at the next step, no further requeue, ``CANCELLED`` with exit status 1;
- a config error: its ``error:`` line in the job's output once, no requeue, ``FAILED``.

On two nodes (``node1`` and ``node2``, each in its own network namespace; skipped in one line
where this machine cannot create them), one rank on each (``GPUS_PER_NODE=1``):

- to completion, with the one-node run's losses, bit for bit;
- one job, three runs: USR1 two steps in (every node's torchrun passes it on; requeue), then,
  once the restart has saved its ``save.interval`` checkpoint and trained two steps more,
  SIGKILL of node2's rank: node1's rank loses its peer, srun ends the step, the script requeues
  (this run moved ``latest``), the third run resumes from that checkpoint and completes; every
  step's loss is the uninterrupted run's.

The losses come from ``logging.metrics_file`` (appended across the requeues). Signals are sent
two steps into a run of 20: the ranks agree on them at the next step boundaries, long before the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
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


def submit(cluster, tmp: Path, *overrides: str, nodes: int = 1) -> int:
    """``sbatch`` as a user on CPU nodes would: 2 ranks in all (``GPUS_PER_NODE=2`` on one node,
    1 on each of two), no GPUs."""
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # torchrun of this environment
        "PYTHONPATH": str(REPO), "GPUS_PER_NODE": str(2 // nodes), "CKPT_DIR": str(tmp / "ckpt"),
        "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
    }
    return cluster.sbatch(f"--nodes={nodes}", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={tmp}/%x-%j.out",
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


# -- two nodes -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes_uninterrupted(slurm_two_nodes, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_nodes")
    job_id = submit(slurm_two_nodes, tmp, nodes=2)
    return tmp, job_id, finished(slurm_two_nodes, job_id)


def test_two_nodes_run_to_completion_with_the_one_node_losses(two_nodes_uninterrupted, uninterrupted):
    """1 rank on each node: the rendezvous on node1 across hosts, gloo between them; the losses
    are the one-node 2-rank run's, bit for bit (the same ranks, the same collectives)."""
    tmp, job_id, fields = two_nodes_uninterrupted
    out = console(tmp, job_id)
    assert outcome(fields) == ("COMPLETED", "0:0", "0"), out[-3000:]
    assert (fields["NodeList"], fields["NumNodes"]) == ("node[1-2]", "2")
    assert re.match(rf"job {job_id} \(restart 0\): 2 nodes x 1 GPUs, rendezvous node1:\d+, ", out), out[:300]
    assert "bebop_megatron: device=cpu world=2 " in out  # one torchrun per node, each with one rank
    assert checkpoints(tmp) == (f"iter_{STEPS:07d}", [f"iter_{SAVE_INTERVAL:07d}", f"iter_{STEPS:07d}"])
    assert losses(tmp) == losses(uninterrupted[0])
    assert [s for s, _ in losses(tmp)] == list(range(1, STEPS + 1))


@pytest.fixture(scope="module")
def two_nodes_preempted_and_failed(slurm_two_nodes, tmp_path_factory):
    """One job, three runs: USR1 two steps in (requeue 1); once the restart has passed its
    save.interval checkpoint by two steps, SIGKILL of node2's ranks (requeue 2); the third run
    completes. Returns the job's fields and output, and what ``latest`` named at the kill."""
    cluster = slurm_two_nodes
    tmp = tmp_path_factory.mktemp("two_nodes_failed")
    job_id = submit(cluster, tmp, nodes=2)
    wait_for_step(cluster, job_id, tmp, 2)
    usr1 = cluster.run("scancel", "--signal=USR1", "--batch", str(job_id))
    assert usr1.returncode == 0, usr1.stderr
    resumed = re.compile(r"^resumed from \S+ at step (\d+) ", re.M)
    wait_until(cluster, job_id, tmp, lambda: resumed.search(console(tmp, job_id)), "the restart")
    wait_for_step(cluster, job_id, tmp, SAVE_INTERVAL + 2)
    latest_at_kill = checkpoints(tmp)[0]
    ranks = cluster.ranks_on("node2")
    assert len(ranks) == 1, ranks  # GPUS_PER_NODE=1
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    fields = finished(cluster, job_id)
    return tmp, job_id, fields, console(tmp, job_id), latest_at_kill


def test_two_nodes_usr1_checkpoints_requeues_and_resumes_with_the_uninterrupted_losses(
        two_nodes_preempted_and_failed, uninterrupted):
    tmp, job_id, fields, out, _ = two_nodes_preempted_and_failed
    ckpt = tmp / "ckpt"
    first_run = out.split(f"job {job_id} (restart 1): ")[0]
    stopped = re.search(rf"^SIGUSR1: checkpoint {ckpt}/iter_(\d+) at step (\d+); exiting with 75 so that the "
                        r"launcher requeues the job$", first_run, re.M)
    assert stopped, out[-3000:]
    step = int(stopped[2])
    assert 2 < step < SAVE_INTERVAL and int(stopped[1]) == step
    # srun passed USR1 to the torchrun of each node, each torchrun to its rank
    assert first_run.count("USR1: the ranks save a checkpoint, then the job is requeued\n") == 1
    assert len(re.findall(r"Sending process \d+ closing signal SIGUSR1", first_run)) == 2
    # srun exits 1 (node2's torchrun, first to end) or 143 (node1's, which srun then terminated)
    assert re.search(rf"^requeueing job {job_id} \(srun exit (1|143)\); it resumes from {ckpt}/latest$", first_run,
                     re.M), first_run[-3000:]
    second_run = out.split(f"job {job_id} (restart 1): ")[1].split(f"job {job_id} (restart 2): ")[0]
    assert f"\nresumed from {ckpt}/iter_{step:07d} at step {step} " in second_run
    reference = dict(losses(uninterrupted[0]))
    rows = losses(tmp)
    assert [s for s, _ in rows[:SAVE_INTERVAL + 2]] == list(range(1, SAVE_INTERVAL + 3))
    assert all(loss == reference[s] for s, loss in rows)


def test_two_nodes_a_killed_node_requeues_from_the_newest_checkpoint(two_nodes_preempted_and_failed, uninterrupted):
    """SIGKILL of node2's rank: node1's rank loses its peer, srun ends the step, and the script
    requeues (this run had saved iter_10); the third run resumes from iter_10, losing only the
    steps after it, and completes with the uninterrupted run's losses."""
    tmp, job_id, fields, out, latest_at_kill = two_nodes_preempted_and_failed
    ckpt = tmp / "ckpt"
    assert outcome(fields) == ("COMPLETED", "0:0", "2"), out[-3000:]
    assert latest_at_kill == f"iter_{SAVE_INTERVAL:07d}"
    second_run, third_run = out.split(f"job {job_id} (restart 1): ")[1].split(f"job {job_id} (restart 2): ")
    # the first torchrun to end: node2's (its rank killed) or node1's (its rank lost the peer)
    assert re.search(r"^srun: error: node[12]: task [01]: Exited with exit code 1$", second_run, re.M), \
        second_run[-3000:]
    requeued = rf"^requeueing job {job_id} after a failure \(srun exit (1|143)\); it resumes from {ckpt}/iter_"
    assert re.search(rf"{requeued}{SAVE_INTERVAL:07d}, this run's last checkpoint$", second_run, re.M), \
        second_run[-3000:]
    assert f"\nresumed from {ckpt}/iter_{SAVE_INTERVAL:07d} at step {SAVE_INTERVAL} " in third_run
    assert f"step    {STEPS}/{STEPS} | " in third_run and "requeueing" not in third_run
    # steps 1..k across the first two runs (k: the last step before the kill), then SAVE_INTERVAL+1..STEPS
    # again: at most save.interval steps lost, every loss the uninterrupted run's
    steps = [s for s, _ in losses(tmp)]
    again = [i for i, s in enumerate(steps) if s == SAVE_INTERVAL + 1][1]  # the third run's first step
    k = steps[again - 1]
    assert SAVE_INTERVAL + 2 <= k < 2 * SAVE_INTERVAL
    assert steps == list(range(1, k + 1)) + list(range(SAVE_INTERVAL + 1, STEPS + 1))
    assert losses(tmp)[k:] == losses(uninterrupted[0])[SAVE_INTERVAL:]
    assert all(loss == dict(losses(uninterrupted[0]))[s] for s, loss in losses(tmp))
    assert checkpoints(tmp)[0] == f"iter_{STEPS:07d}"
