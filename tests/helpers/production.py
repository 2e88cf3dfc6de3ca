"""Start ranks the way srun does (one process each, no torchrun) and read their streams."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import forkserver
from tests.helpers.launch import REPO, _free_port

SCRIPT = REPO / "tests" / "helpers" / "production_run.py"


def start_ranks(stream: Path, args: list[str], nproc: int, tag: str = "",
                process_group: bool = False) -> list[subprocess.Popen]:
    """Popen one process per rank of ``production_run.py``; stdout/stderr go to files beside ``stream``.

    ``process_group``: the ranks (and whatever they start) share a new process group whose id
    is rank 0's pid, as under srun or torchrun, so a test can signal the whole group."""
    port = str(_free_port())
    procs = []
    for rank in range(nproc):
        env = {
            **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
        }
        out = open(f"{stream}{tag}.out{rank}", "w")
        err = open(f"{stream}{tag}.err{rank}", "w")
        group = {"process_group": procs[0].pid if procs else 0} if process_group else {}
        procs.append(forkserver.popen(
            [sys.executable, str(SCRIPT), "--stream", str(stream), *args], cwd=REPO, env=env, stdout=out, stderr=err,
            **group,
        ))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = 240) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    return codes


def run_ranks(stream: Path, args: list[str], nproc: int, tag: str = "") -> list[int]:
    return wait_all(start_ranks(stream, args, nproc, tag))


def read_stream(stream: Path) -> list[dict]:
    if not stream.exists():
        return []
    return [json.loads(line) for line in stream.read_text().splitlines() if line.strip()]


def wait_for_step(stream: Path, step: int, procs: list[subprocess.Popen], timeout: float = 240) -> None:
    """Poll until rank 0 has streamed ``step`` (fails if a rank exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = read_stream(stream)
        if rows and rows[-1]["step"] >= step:
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a rank exited before step {step}: {[p.poll() for p in procs]}")
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def output(stream: Path, rank: int, tag: str = "") -> tuple[str, str]:
    return Path(f"{stream}{tag}.out{rank}").read_text(), Path(f"{stream}{tag}.err{rank}").read_text()
