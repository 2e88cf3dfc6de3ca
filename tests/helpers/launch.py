"""Launch ``tests/helpers/*.py`` scripts on 1 or 2 CPU ranks (gloo) from tests."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import forkserver

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "helpers"


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _free_port() -> int:
    """A port free now, for a server that a process started later binds (a rendezvous, a store).

    Drawn at random below the kernel's ephemeral range, not with ``bind(0)``: the kernel hands
    ports of that range to every outgoing connection and every ``bind(0)``, so under pytest-xdist
    another test's socket could take a ``bind(0)`` port between this check and the server's bind
    (a real-Slurm job's torchrun then timed out as a client of a store that was not its own).
    Free means bindable on every address (the server may bind the host's name or 0.0.0.0)."""
    lo, _ = _ephemeral_range()
    rng = random.Random(int.from_bytes(os.urandom(8), "little"))
    for _ in range(200):
        port = rng.randrange(20000, max(lo, 20001))
        try:
            for host in ("127.0.0.1", "0.0.0.0"):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    with socket.socket() as s:  # every draw taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_torchrun(script: Path, args: list[str], folder: Path, nproc: int = 2) -> subprocess.Popen:
    """``script`` under torchrun on ``nproc`` CPU ranks, one thread each, in the background: stdout
    and stderr to ``folder/out`` and ``folder/err``, this process's rank variables left out (the
    tests that signal or kill torchrun itself)."""
    from tests.helpers.single_process import ENV_NAMES

    env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(folder / "out", "w") as out, open(folder / "err", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
             "127.0.0.1", "--master_port", str(_free_port()), str(script), *args],
            cwd=REPO, env=env, stdout=out, stderr=err,
        )


def run_script(script: str, args: list[str], nproc: int, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    path = str(HELPERS / script) if not os.path.isabs(script) else script
    if nproc == 1:
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        env["MASTER_PORT"] = str(_free_port())
        cmd = [sys.executable, path, *args]
        proc = forkserver.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    else:
        # the ranks as torchrun starts its workers, without its agent process (cli_batch.launch_ranks)
        from tests.helpers.cli_batch import launch_ranks

        cmd = [path, *args]
        proc = launch_ranks(cmd, nproc, env, timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} on {nproc} rank(s) failed with {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


def run_case(out: Path, overrides: list[str], nproc: int, save_model: Path | None = None) -> dict:
    args = ["--out", str(out)]
    if save_model is not None:
        args += ["--save-model", str(save_model)]
    run_script("run_case.py", args + overrides, nproc)
    with open(out / "result.json") as f:
        return json.load(f)


def run_cases(cases: list[tuple[Path, list[str], Path | None]], nproc: int, workdir: Path,
              alone: int = 0) -> list[dict]:
    """Several ``run_case.py`` cases ``(out, overrides, save_model)`` in one launch; the first
    ``alone`` of them are single-process runs, shared out over the ranks (each by itself)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "cases.json"
    spec.write_text(json.dumps([{"out": str(out), "overrides": overrides,
                                 "save_model": None if save is None else str(save), "alone": i < alone}
                                for i, (out, overrides, save) in enumerate(cases)]))
    run_script("run_case.py", ["--cases", str(spec)], nproc, timeout=900)
    results = []
    for out, _, _ in cases:
        with open(Path(out) / "result.json") as f:
            results.append(json.load(f))
    return results


def load_grads(path: Path) -> dict:
    """Full (unsharded) tensors of a distributed checkpoint, without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    plain = path.parent / (path.name + ".pt")
    if not plain.exists():
        dcp_to_torch_save(str(path), str(plain))
    import torch

    loaded = torch.load(plain, map_location="cpu", weights_only=False)
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
