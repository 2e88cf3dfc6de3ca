"""kill -9 of torchrun: its two ranks must not train on under PID 1 (bebop_megatron/launcher.py).

torchrun starts two CPU ranks of tests/helpers/production_run.py (TP=2, a long run); after a
step, torchrun is killed with SIGKILL, so it cannot stop its workers. Each rank's watchdog sees
its parent gone and sends itself SIGTERM; the ranks agree on it at the next step, save a
checkpoint and exit as on preemption: both pids are gone within seconds and ``latest`` names a complete checkpoint.
"""

from __future__ import annotations

import os
import signal
import time

import psutil

from tests.helpers.launch import REPO, start_torchrun
from tests.helpers.production import read_stream

SCRIPT = REPO / "tests" / "helpers" / "production_run.py"
TINY = [
    "device=cpu", "parallel.tensor=2", "train.micro_batch_size=2", "train.global_batch_size=4", "train.seq_length=32",
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=200",
    "train.steps=100000",
]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # orphans may wait unreaped
    except psutil.NoSuchProcess:
        return False


def test_ranks_stop_when_torchrun_is_killed(tmp_path):
    stream, ckpt = tmp_path / "steps.jsonl", tmp_path / "ckpt"
    torchrun = start_torchrun(SCRIPT, ["--stream", str(stream), *TINY, f"save.dir={ckpt}"], tmp_path)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not (read_stream(stream) and all((tmp_path / f"steps.jsonl.pid{r}").exists() for r in (0, 1))):
            assert torchrun.poll() is None, (tmp_path / "err").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step within 240 s"
            time.sleep(0.1)
        pids = [int((tmp_path / f"steps.jsonl.pid{r}").read_text()) for r in (0, 1)]
        os.kill(torchrun.pid, signal.SIGKILL)
        torchrun.wait()
        killed = time.monotonic()
        while any(running(pid) for pid in pids) and time.monotonic() < killed + 30:
            time.sleep(0.1)
        assert not any(running(pid) for pid in pids), f"ranks still running 30 s after kill -9 of torchrun: {pids}"
    finally:
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    stderr, stdout = (tmp_path / "err").read_text(), (tmp_path / "out").read_text()
    # the first rank to notice stops both (they agree at the next step), maybe before the other notices
    assert f"] the launcher (pid {torchrun.pid}) is gone: stopping this rank" in stderr, stderr[-3000:]
    # what happened, not an error (issue 26 item 23): no "error:" line, the last line names the launcher
    assert not [line for line in stderr.splitlines() if line.startswith("error:")], stderr[-3000:]
    assert f"the launcher (pid {torchrun.pid}) is gone" in stdout.strip().splitlines()[-1], stdout[-3000:]
    latest = (ckpt / "latest").read_text()
    assert (ckpt / latest / "metadata.json").exists() and not list(ckpt.glob("*.tmp"))
    assert not (ckpt / "run.lock").exists()
