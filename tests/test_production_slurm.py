"""slurm/train_tv.sbatch: syntax, and a dry run under a fake 2-node Slurm environment.

Fake ``srun``, ``scontrol`` and ``torchrun`` on PATH record their command lines: srun prints
its own line and runs its task once per node (as ``srun --ntasks-per-node=1`` would), the fake
torchrun prints what each node would start. Preemption is simulated by a fake srun that sends
the batch script the signal Slurm sends (USR1 before the time limit) and waits for the
forwarded one, the way torchrun passes it to the ranks.
"""

from __future__ import annotations

import os
import stat
import subprocess
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
    preempt | cancel)
        # Slurm signals the batch shell (USR1 before the time limit, TERM on scancel); srun
        # must receive the forwarded signal and then exit 1 (torchrun reports the ranks' 75 as 1).
        trap 'echo "srun got USR1"; exit 1' USR1
        trap 'echo "srun got TERM"; exit 1' TERM
        if [[ $FAKE_SRUN_MODE == preempt ]]; then kill -USR1 "$PPID"; else kill -TERM "$PPID"; fi
        for _ in $(seq 100); do sleep 0.1; done
        echo "srun: no signal forwarded"; exit 3 ;;
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
echo "[$SLURMD_NODENAME] torchrun $* (signals: $TORCHELASTIC_SIGNALS_TO_HANDLE)"
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


@pytest.mark.parametrize(
    "mode, rc, requeued",
    [("exit75", 75, True), ("preempt", 1, True), ("cancel", 1, False), ("fail", 1, False)],
    ids=["requeue-exit-code", "time-limit-usr1", "scancel-term-is-not-requeued", "crash-is-not-requeued"],
)
def test_requeue(fake_slurm, mode, rc, requeued):
    env, tmp = fake_slurm
    proc = sbatch(env, "cfg.yaml", FAKE_SRUN_MODE=mode)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    log = tmp / "scontrol.log"
    assert (log.read_text() if log.exists() else "") == ("scontrol requeue 4242\n" if requeued else "")
    if mode in ("preempt", "cancel"):  # the trap forwarded the signal to srun
        assert ("srun got USR1" if mode == "preempt" else "srun got TERM") in proc.stdout
