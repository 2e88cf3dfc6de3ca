"""``benchmarks/loss_inputs.py``'s timed baseline (``naive_loss``, the plain e2e TV formula of
``benchmark_tv_loss.py``) against the float64 reference ``bebop_megatron.losses.reference``."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

from bebop_megatron.losses import reference
from tests.helpers.launch import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from loss_inputs import inputs, naive_loss  # noqa: E402


def test_naive_loss_is_the_reference_e2e_tv():
    draft, backbone, weight, valid = (t.detach().double() if t.is_floating_point() else t
                                      for t in inputs(SimpleNamespace(steps=3, tokens=9, hidden=8, vocab=40)))
    K, T = valid.shape[:2]
    draft.requires_grad_(True)
    loss = naive_loss(draft, backbone, weight, valid)
    (grad,) = torch.autograd.grad(loss, draft)
    # the reference on logits: step k (1-based) targets the backbone's logits at t + k, zeros past the end
    z = torch.cat([backbone[:, 0] @ weight.t(), torch.zeros(K, weight.shape[0], dtype=torch.float64)])
    target = torch.stack([z[k + 1:k + 1 + T] for k in range(K)])
    draft_ref = draft.detach().clone().requires_grad_(True)
    want = reference.objective("e2e_tv", draft_ref[:, :, 0] @ weight.t(), target, valid[:, :, 0])
    (grad_ref,) = torch.autograd.grad(want, draft_ref)
    assert valid[:, :, 0].sum() < K * T  # the chain ends are in it
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)


def test_benchmark_tv_loss_runs_both_objectives(tmp_path):
    """``benchmark_tv_loss.py`` at a tiny size, e2e TV and ce: the fused loss and its baseline (naive_loss;
    Megatron's cross-entropy on full logits) give the same loss, and the rows are written."""
    import csv
    import os
    import subprocess

    env = {**os.environ, "BENCH_RESULTS_CSV": str(tmp_path / "rows.csv"), "OMP_NUM_THREADS": "1"}
    for objective in ("e2e_tv", "ce"):
        proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "benchmark_tv_loss.py"), "--objective", objective,
                               "--tokens", "24", "--hidden", "16", "--vocab", "64", "--chunk-tokens", "8", "--iters", "1",
                               "--warmup", "0"], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "rows.csv")))
    diffs = {("objective=ce" in r["params"]): float(r["value"]) for r in rows if r["metric"] == "loss_abs_diff"}
    assert set(diffs) == {False, True} and max(diffs.values()) < 1e-5, diffs
