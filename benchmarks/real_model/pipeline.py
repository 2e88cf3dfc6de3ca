"""Shared pieces of the real-model benchmark: the cache layout, subprocess steps, timing.

Everything downloaded or produced (wheels, the GGUF file, the HF and Megatron checkpoints,
generated data, training runs) lives in the cache directory, outside the repository:
``$BEBOP_CACHE`` or ``~/.cache/bebop_megatron``, then ``qwen2.5-coder-1.5b/``. Only the
result tables (``RESULTS.md``, rows of ``benchmarks/results.csv``) are committed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "qwen2.5-coder-1.5b"


class PrepareError(Exception):
    """A user-facing failure of a benchmark step (printed as one ``error:`` line, exit 2)."""


def cache_root() -> Path:
    return Path(os.environ.get("BEBOP_CACHE", Path.home() / ".cache" / "bebop_megatron")) / MODEL_NAME


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], *, what: str, env: dict | None = None, cwd: Path = REPO) -> None:
    """Run a step's command with its output streamed; a failure names the step and the command."""
    log(f"{what}: {' '.join(str(c) for c in cmd)}")
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise PrepareError(f"{what} failed with exit status {proc.returncode} (command above)")


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]


def main_guard(fn) -> None:
    """Run ``fn`` turning :class:`PrepareError` into one ``error:`` line and exit status 2."""
    try:
        fn()
    except PrepareError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted; re-run to continue from the last finished step", file=sys.stderr)
        sys.exit(130)
