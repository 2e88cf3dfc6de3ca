"""``benchmarks/gpu/run_all.sh --dry-run``: the GPU script's parts still run (CPU, tiny sizes).

The real run needs one NVIDIA GPU; this keeps the script from rotting where there is none:
every part runs (the context-parallel benchmark at C=2 on two CPU ranks, the loss benchmark with
the torch kernel, the training-step benchmark, the collection of the GPU-marked tests, the
generation benchmark on a tiny model, the GPU study's smoke run, real_model.sh smoke),
exits 0 and writes its CSV rows. The loss benchmark's
result is checked against the float64 reference (``bebop_megatron/losses/reference.py``).
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys

from tests.helpers.launch import REPO


def test_run_all_dry_run(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    env.pop("BENCH_RESULTS_CSV", None)
    proc = subprocess.run(["bash", str(REPO / "benchmarks/gpu/run_all.sh"), "--dry-run", "--out", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    for part in ("cp", "loss", "step", "tests", "generate", "study"):
        assert f"=== {part}: exit 0" in summary, summary
    assert "33/" in (tmp_path / "tests.log").read_text()  # the GPU-marked Triton tests were collected
    study = (tmp_path / "study.log").read_text()  # the tool's report, then the two returned heads
    assert "study done" in study and study.count("heads: ") == 2, study[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "results_gpu.csv")))
    metrics = {(r["benchmark"], r["metric"]): float(r["value"]) for r in rows if r["metric"] != "note"}
    assert metrics[("benchmark_tv_loss_impls", "torch_loss_abs_diff_float64")] < 1e-2  # bf16 inputs
    assert metrics[("benchmark_tv_loss_impls", "torch_ms")] > 0 < metrics[("benchmark_tv_loss_impls", "gemm_ms")]
    # the profile groups each step's time: the GEMM-only variant is GEMMs; the loss has GEMMs and more
    assert metrics[("benchmark_tv_loss_impls", "gemm_prof_gemm_share")] > 0.5
    assert 0 < metrics[("benchmark_tv_loss_impls", "torch_prof_gemm_share")] < 1
    assert metrics[("bench_train_step", "tokens_per_s")] > 0
    assert metrics[("bench_train_step", "peak_mem_gib")] > 0
    assert math.isnan(metrics[("bench_train_step", "mfu")])  # no peak FLOP/s known for a CPU
    # the step's before/after variants, one run: the unfused attention at micro-batch 1, SDPA at 2
    step = {r["params"].split("micro_batch=")[1].split()[0] + "/" + r["params"].split("attention=")[1]
            for r in rows if r["benchmark"] == "bench_train_step" and r["metric"] == "tokens_per_s"}
    assert step == {"1/unfused", "2/sdpa"}, step
    # generation: both variants wrote tokens; in fp32 the batched sampler's ids equal transformers'
    assert metrics[("bench_generate", "hf_tokens_per_s")] > 0 < metrics[("bench_generate", "megatron_tokens_per_s")]
    assert metrics[("bench_generate", "megatron_tokens")] == metrics[("bench_generate", "hf_tokens")] > 0
    assert metrics[("bench_generate", "megatron_agree")] == 1.0
    # context parallelism runs first (two ranks, tiny rows); its peak is the whole process's resident set
    cp = {r["metric"]: float(r["value"]) for r in rows if r["benchmark"] == "bench_context_parallel"}
    assert cp["step_ms"] > 0 and cp["peak_mb_per_rank"] > 100 and cp["loss0"] > 0, cp
    assert [r["benchmark"] for r in rows][0] == "bench_context_parallel"
    assert all(r["machine"].endswith("; cpu)") for r in rows)
