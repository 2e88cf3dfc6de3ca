"""Shared pieces of the benchmarks: worker processes, memory readings, the results CSV.

Every benchmark runs its variants in separate worker processes (a fresh process gives each
variant its own peak-memory reading) that the driver keeps alive and steps round-robin, so
a change of machine load during the run hits all variants alike. Workers answer with one
JSON object per line, prefixed by ``TAG``.

``results.csv`` is long-format, one row per measured number, so benchmarks with different
parameters share it: ``date, machine, torch, megatron_core, device, benchmark, params,
metric, value`` (``params`` is ``key=value`` pairs separated by spaces).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import threading
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

TAG = "BENCH_JSON "
CSV_PATH = Path(__file__).with_name("results.csv")
COLUMNS = ["date", "machine", "torch", "megatron_core", "device", "benchmark", "params", "metric", "value"]


def reply(obj: dict) -> None:
    """Worker side: one JSON answer on stdout, written by one ``write`` (a line under PIPE_BUF
    bytes is not interleaved with another rank's on a shared pipe; ``print`` writes the text and
    the newline apart, and two ranks' answers once came out as one line)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (TAG + json.dumps(obj) + "\n").encode())


def rss_mb(peak: bool = False) -> float:
    """Peak (ru_maxrss: KiB on Linux) or current (/proc/self/statm) resident set size."""
    if peak or not os.path.exists("/proc/self/statm"):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRSS:
    """Context manager sampling the current RSS every ``interval`` s: ``.extra_mb`` is the
    highest reading above the reading at entry (large CPU tensors are mmap-backed, so the
    RSS follows live tensor memory; a GB-sized buffer lives far longer than one interval)."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.extra_mb = interval, 0.0

    def __enter__(self):
        self._base = self._peak = rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, rss_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, rss_mb())
        self.extra_mb = self._peak - self._base
        return False


def free_port() -> int:
    """A free local port, should a worker initialise torch.distributed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Worker:
    """One variant in its own process (``cmd``), answering on request; stderr kept in a temp file."""

    def __init__(self, name: str, cmd: list[str], env: dict | None = None):
        """``env``: extra environment (the ranks of one multi-process variant share a MASTER_PORT)."""
        self.name, self.err = name, tempfile.TemporaryFile("w+")
        env = {**os.environ, "MASTER_PORT": str(free_port()), **(env or {})}
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def ask(self, command: str) -> dict:
        self.send(command)
        return self.read()

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
        self.err.seek(0)
        sys.exit(f"variant {self.name} failed (exit {self.proc.wait()}):\n{self.err.read()[-4000:]}")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def device_label(device: str) -> str:
    """The accelerator's name for the ``machine`` column (``cpu`` without one)."""
    if device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


def append_results(benchmark: str, device: str, params: dict, metrics: dict, torch_version: str,
                   machine_extra: str = "", machine: str | None = None) -> None:
    """Append one row per metric to ``results.csv`` (header written when the file is new), or to
    ``$BENCH_RESULTS_CSV`` when set (the GPU script writes there, then its rows are copied over).
    ``machine_extra`` (e.g. the GPU's name) is added to the ``machine`` column; ``machine``
    replaces it (rows written here from numbers another machine measured)."""
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if machine is None:
        machine = f"{platform.node()} ({os.cpu_count()} cpus{'; ' + machine_extra if machine_extra else ''})"
    param_str = " ".join(f"{k}={v}" for k, v in params.items())
    path = Path(os.environ.get("BENCH_RESULTS_CSV") or CSV_PATH)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(COLUMNS)
        for metric, value in metrics.items():
            w.writerow([stamp, machine, torch_version, version("megatron-core"), device, benchmark, param_str, metric,
                        value if isinstance(value, str) else f"{value:.6g}"])
    print(f"appended {len(metrics)} rows to {path}")


def replace_marked_section(body: str, text: str, begin: str, end: str) -> str:
    """``body`` (a RESULTS.md) with the section between the markers ``begin`` and ``end``
    replaced by ``text`` (which carries the markers itself), appended when absent."""
    if begin in body and end in body:
        body = body[: body.index(begin)].rstrip() + "\n" + body[body.index(end) + len(end):].lstrip("\n")
    return body.rstrip() + "\n\n" + text + "\n"
