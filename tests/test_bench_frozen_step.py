"""The frozen-step benchmark's bookkeeping: the self-check and the PP=2 ideal and bubbles.

The benchmark itself is too slow for the suite (minutes on 2 cores); these check its
arithmetic against hand-computed values.
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers.launch import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from bench_frozen_step import self_check  # noqa: E402
from frozen_pipeline import summarise  # noqa: E402


def test_self_check_fails_on_a_different_objective():
    same = {"loss0": 0.3163, "grad_norm0": 0.0723}
    assert self_check({"F": same, "a": dict(same), "b": dict(same, grad_norm0=5.0)}) == []
    # issue 17: the lower bound computed CE (7.66) while F computed e2e TV (0.316)
    failures = self_check({"F": same, "a": dict(same, loss0=7.66), "b": dict(same)})
    assert failures == ["a first-step loss 7.660000 != F 0.316300"]
    assert len(self_check({"F": same, "a": dict(same, grad_norm0=0.08), "b": dict(same)})) == 1


def test_pp2_ideal_and_bubbles():
    M = 4
    # stage 0: 4 forwards of 10 ms + 30 ms waiting in send; stage 1: 4 x 25 ms MTP-stage work,
    # 12 ms waiting for the first micro-batch, 5 ms optimizer
    step = [{"wall": 0.140, "fb": 0.070, "opt": 0.070, "p2p": 0.030},
            {"wall": 0.117, "fb": 0.112, "opt": 0.005, "p2p": 0.012}]
    ends = [{"trainable": False, "mem_mb": 1.0, "num_layers_here": 6, "threads": 1, "torch": "x"},
            {"trainable": True, "mem_mb": 2.0, "num_layers_here": 6, "threads": 1, "torch": "x"}]
    r = summarise([step, step], ends, M)
    ideal = 0.010 + 0.025 + (M - 1) * 0.025 + 0.005  # t0 + t1 + (M - 1) max(t0, t1) + o = 115 ms
    assert r["ideal_ms"] == pytest.approx(1e3 * ideal)
    assert r["step_ms"] == pytest.approx(140.0)
    assert r["ratio_ideal"] == pytest.approx(0.140 / ideal)
    assert r["busy_ms"] == pytest.approx([40.0, 105.0])  # stage 0: no optimizer work counted
    assert r["bubble_ms"] == pytest.approx([100.0, 35.0])
