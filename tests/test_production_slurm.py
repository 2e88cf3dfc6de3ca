"""slurm/train_tv.sbatch: syntax and what the script decides, under a fake 2-node Slurm.

Fake ``srun``, ``scontrol`` and ``torchrun`` on PATH record their command lines: srun prints
its own line and runs its task once per node (as ``srun --ntasks-per-node=1`` would), the fake
torchrun prints what each node would start. Also: a container image's options, the requeue on a
status 75 passed through (torchrun reports it as 1), the requeue after a failure only when the
run moved ``latest``, and under a real torchrun, rank 0's error line when another rank fails
first. Submission, USR1, TERM and a failing run under a real one-node Slurm, and two nodes (USR1,
a node's ranks killed) under a real two-node one: tests/test_production_slurm_real.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "slurm" / "train_tv.sbatch"

FAKE_SRUN = r"""#!/bin/bash
echo "srun $*"
i=0
while [[ $1 == --* ]]; do
    case $1 in --container-*) shift 2 ;; *) shift ;; esac
done
case ${FAKE_SRUN_MODE:-run} in
    run)
        for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
            SLURM_NODEID=$i SLURMD_NODENAME=$node "$@"
            i=$((i + 1))
        done ;;
    exit75) exit 75 ;;
    fail) exit 1 ;;
    save_then_fail) mkdir -p "$CKPT_DIR" && echo iter_0000020 > "$CKPT_DIR/latest" && exit 1 ;;
esac
"""

FAKE_SCONTROL = r"""#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then
    [[ $3 == "gpu[001-002]" ]] || { echo "unexpected nodelist $3" >&2; exit 1; }
    printf 'gpu001\ngpu002\n'
else
    echo "scontrol $*" >> "$FAKE_LOG"
fi
"""

FAKE_TORCHRUN = r"""#!/bin/bash
echo "[$SLURMD_NODENAME] torchrun $* (signals: $PET_SIGNALS_TO_HANDLE)"
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, "torchrun": FAKE_TORCHRUN}.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "bebop-mtp",
        "SLURM_JOB_NODELIST": "gpu[001-002]",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "FAKE_LOG": str(tmp_path / "scontrol.log"),
    }
    return env, tmp_path


def sbatch(env: dict, *args: str, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SBATCH), *args], cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=30
    )


def test_sbatch_syntax():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    assert os.access(SBATCH, os.X_OK)


def test_dry_run_prints_srun_and_torchrun_command_lines(fake_slurm):
    env, tmp = fake_slurm
    proc = sbatch(env, "examples/configs/cluster/moe_30b_4node.yaml", "train.steps=10", "logging.wandb.mode=offline",
                  CKPT_DIR="/lustre/ckpt/run1")
    assert proc.returncode == 0, proc.stderr
    torchrun = (
        "torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint gpu001:29500 "
        "--rdzv_id 4242 --shutdown-timeout 600 examples/pretrain_mtp.py "
        "--config examples/configs/cluster/moe_30b_4node.yaml train.resume=auto save.dir=/lustre/ckpt/run1 "
        "train.steps=10 logging.wandb.mode=offline"
    )
    signals = "(signals: SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1)"
    lines = proc.stdout.splitlines()
    assert lines == [
        "job 4242 (restart 0): 2 nodes x 8 GPUs, rendezvous gpu001:29500, checkpoints /lustre/ckpt/run1",
        f"srun --kill-on-bad-exit=1 {torchrun}",
        f"[gpu001] {torchrun} {signals}",
        f"[gpu002] {torchrun} {signals}",
    ]
    assert not (tmp / "scontrol.log").exists()  # a finished run is not requeued


def test_container_image_and_defaults(fake_slurm):
    env, _ = fake_slurm
    proc = sbatch(env, "cfg.yaml", CONTAINER_IMAGE="/img/bebop.sqsh", GPUS_PER_NODE="4", MASTER_PORT="6000")
    assert proc.returncode == 0, proc.stderr
    srun = next(line for line in proc.stdout.splitlines() if line.startswith("srun "))
    assert srun.startswith(
        f"srun --kill-on-bad-exit=1 --container-image /img/bebop.sqsh --container-mounts {REPO}:{REPO} "
        f"--container-workdir {REPO} torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d "
        "--rdzv_endpoint gpu001:6000 "
    )
    assert srun.endswith("--config cfg.yaml train.resume=auto save.dir=checkpoints/bebop-mtp")


def test_missing_config_argument_is_an_error(fake_slurm):
    env, _ = fake_slurm
    proc = sbatch(env)
    assert proc.returncode != 0 and "usage: sbatch slurm/train_tv.sbatch CONFIG.yaml" in proc.stderr


def test_a_launcher_that_passes_75_through_is_requeued(fake_slurm):
    """The status 75 itself (torchrun reports it as 1): USR1, TERM and failures under a real Slurm
    are tests/test_production_slurm_real.py's."""
    env, tmp = fake_slurm
    proc = sbatch(env, "cfg.yaml", FAKE_SRUN_MODE="exit75")
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert (tmp / "scontrol.log").read_text() == "scontrol requeue 4242\n"


def test_a_failure_after_a_new_checkpoint_is_requeued(fake_slurm):
    """A node lost or a rank killed after this run moved ``latest`` (srun ends with 1 or 143):
    requeued, to resume from that checkpoint. Under a real two-node Slurm (node2's rank killed):
    tests/test_production_slurm_real.py."""
    env, tmp = fake_slurm
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("iter_0000010\n")  # what the run resumed from
    proc = sbatch(env, "cfg.yaml", FAKE_SRUN_MODE="save_then_fail", CKPT_DIR=str(ckpt))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == (f"requeueing job 4242 after a failure (srun exit 1); it resumes from "
                                            f"{ckpt}/iter_0000020, this run's last checkpoint")
    assert (tmp / "scontrol.log").read_text() == "scontrol requeue 4242\n"


@pytest.mark.parametrize("before", [None, "iter_0000010\n"])
def test_a_failure_before_a_new_checkpoint_is_not_requeued(fake_slurm, before):
    """No checkpoint at all, or none since the run started: the failure would likely recur (a
    config or data error, a crash at start); the job ends, saying why."""
    env, tmp = fake_slurm
    ckpt = tmp / "ckpt"
    if before:
        ckpt.mkdir()
        (ckpt / "latest").write_text(before)
    proc = sbatch(env, "cfg.yaml", FAKE_SRUN_MODE="fail", CKPT_DIR=str(ckpt))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.splitlines()[-1]
    assert last == "job 4242 failed (srun exit 1) before this run saved a checkpoint: not requeued"
    assert not (tmp / "scontrol.log").exists()


def test_rank0_reports_an_error_that_another_rank_raised_first(tmp_path):
    """torchrun stops every rank once one fails: under sbatch, rank 1 exiting first on a config error
    cut rank 0 off before its line (bebop_megatron.launcher.leave_report_to_rank0). Rank 0 starts
    3 s late here; its line comes once, and torchrun's first failure is rank 0's status 2."""
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", "tests/helpers/late_rank0.py", "--config", "examples/configs/tiny_cpu.yaml", "train.stepz=3"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: unknown config key 'train.stepz' (did you mean 'train.steps'?)"], proc.stderr[-3000:]
    root_cause = proc.stderr.split("Root Cause")[1]
    assert "rank      : 0 (local_rank: 0)" in root_cause and "exitcode  : 2 " in root_cause, root_cause


def test_outside_torchrun_a_failing_rank_does_not_wait(monkeypatch):
    from bebop_megatron import launcher

    monkeypatch.setattr(launcher, "_watched", None)  # watch_launcher found no torchrun
    monkeypatch.setattr(launcher.time, "sleep", lambda s: pytest.fail(f"slept {s} s"))
    launcher.leave_report_to_rank0()


def test_without_network_namespaces_the_two_node_slurm_is_skipped_in_one_line(tmp_path, monkeypatch):
    """Where ``ip netns add`` is refused (a container without the capability), the two-node
    fixture skips with the reason in one line, and leaves nothing behind."""
    from tests.helpers.slurm_cluster import NETNS_PROGRAMS, missing_namespaces

    refused = "mount --make-shared /run/netns failed: Operation not permitted"
    for program in NETNS_PROGRAMS:
        path = tmp_path / program
        path.write_text(f'#!/bin/sh\necho "$*" >> "$0.log"\n'
                        f'case "$*" in "netns add"*) echo "{refused}" >&2; exit 1 ;; esac\n')
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    reason = missing_namespaces()
    assert reason == ("a two-node Slurm needs network namespaces, which this machine cannot create (ip netns add "
                      f"bebop-probe{os.getpid()}-node1: {refused})")
    calls = (tmp_path / "ip.log").read_text().splitlines()
    assert calls[-1] == f"link del bbp{os.getpid()}"  # the bridge made before the namespace, removed again
