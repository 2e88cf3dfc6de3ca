"""The context-parallel benchmark's bookkeeping: the one-line refusals, the per-step reduction
over ranks and the side-by-side table.

The benchmark itself launches torchrun per variant (minutes at its real lengths);
``benchmarks/gpu/run_all.sh --dry-run`` (tests/test_gpu_script.py) runs it at C=2 on tiny rows.
These check its arithmetic against hand-computed values.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tests.helpers.launch import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from bench_context_parallel import _busy_cpu_s, _own_cpu_s, check_args, summarise, table  # noqa: E402

SCRIPT = REPO / "benchmarks" / "bench_context_parallel.py"


def _args(**kw):
    base = dict(seq=[32768, 65536], cp=[1, 2], steps=3, threads=1, mtp_steps=3, device="cpu")
    return argparse.Namespace(**{**base, **kw})


def test_refusals_name_the_problem():
    assert check_args(_args()) is None
    assert "not divisible by 2 x C = 4" in check_args(_args(seq=[32768, 32770]))
    assert "not divisible by 2 x C = 6" in check_args(_args(cp=[1, 3], seq=[32768]))  # 32768 % 6 != 0
    assert "--steps 1" in check_args(_args(steps=1))  # the first step is a warm-up: nothing left to time
    assert "shorter than --mtp-steps 3" in check_args(_args(seq=[8]))  # chunks of S/2C = 2 positions


def test_bad_length_fails_with_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seq", "32770"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: --seq 32770 is not divisible by 2 x C = 4 (C=2: each row is split into 2C chunks, "
        "rank r holds chunks r and 2C-1-r)"]


def _rank(times, loss_sums, counts, peak, step_mb):
    return {"steps": [{"s": t, "loss_sum": l, "count": c} for t, l, c in zip(times, loss_sums, counts)],
            "peak_mb": peak, "step_mb": step_mb, "threads": 1, "torch": "x"}


def test_summarise_and_table():
    # C=1: steps of 9 (warm-up), 4, 6 s; loss sums over 100 positions
    c1 = summarise([_rank([9.0, 4.0, 6.0], [50.0, 40.0, 30.0], [100, 100, 100], 2000.0, 1500.0)])
    assert c1["ms"] == pytest.approx(5000.0)  # median of 4 and 6 s
    assert c1["losses"] == pytest.approx([0.5, 0.4, 0.3])
    # C=2: a step lasts as long as its slowest rank; the loss is the sums over both ranks' positions
    c2 = summarise([_rank([5.0, 2.0, 3.5], [20.0, 15.0, 10.0], [50, 50, 50], 1100.0, 700.0),
                    _rank([5.5, 2.5, 3.0], [30.0, 25.0, 20.0], [50, 50, 50], 1200.0, 650.0)])
    assert c2["ms"] == pytest.approx(3000.0)  # median of max(2, 2.5) and max(3.5, 3)
    assert c2["losses"] == pytest.approx([0.5, 0.4, 0.3])
    assert (c2["peak_mb"], c2["step_mb"]) == (1200.0, 700.0)  # the largest rank's
    head, line = table([(32768, {1: c1, 2: c2}, {2: 1e-7})], [1, 2])
    assert head.split() == ["S", "C=1", "ms", "C=1", "MB/rank", "C=2", "ms", "C=2", "MB/rank", "time", "C2/C1",
                            "mem", "C2/C1", "loss", "diff"]
    assert line.split() == ["32768", "5000", "2000", "3000", "1200", "0.600", "0.600", "1.0e-07"]


def test_the_other_processes_cpu_is_the_machines_less_the_benchmarks_own():
    """Half a second of this process's CPU shows in the benchmark's own CPU time and in the
    machine's busy time, the two terms whose difference is what other processes used."""
    import time

    busy0, own0, t0 = _busy_cpu_s(), _own_cpu_s(), time.process_time()
    while time.process_time() - t0 < 0.5:
        pass
    busy, own = _busy_cpu_s() - busy0, _own_cpu_s() - own0
    assert own >= 0.45
    assert busy >= 0.9 * own  # the machine counted this process's second too (clock ticks: coarse)
