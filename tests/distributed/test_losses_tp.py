"""Vocabulary-parallel objectives (TP=2, 2 gloo ranks) equal the unsharded call.

``tests/helpers/losses_tp_case.py`` runs every objective (the cold-start ones included) and ``tv_distance`` in fp32 and
fp64 with temperatures 0.7/1.3, grad_output 2.7, chunks smaller than N, cut and fully
masked chains and argmax ties across shards; it compares loss, stats and the gathered
draft-logit gradient with TP=1 on rank 0. With ``vocab_size`` (Megatron's padded columns
from there on, on rank 1 partly or wholly) the reference is TP=1 on the unpadded logits. The fused ``ce``'s cross-entropy row kernel
(``label_cross_entropy_``) is compared with float64 ``cross_entropy`` on the full vocabulary.
"""

from __future__ import annotations

import json

import pytest

from bebop_megatron.losses.objectives import DISTRIBUTION_NAMES as OBJECTIVE_KINDS
from tests.helpers.launch import run_script

EXPECTED = {
    f"{kind}/{dtype}" for kind in (*OBJECTIVE_KINDS, "tv_distance") for dtype in ("fp32", "fp64")
} | {"e2e_tv/fp32/grad_in_forward", "e2e_tv/fp32/sum", "e2e_lk/fp32/grad_in_forward", "lk/fp64/lk_eta=0.5"} | {
    f"{kind}/fp64/vocab_size={v}" for kind in OBJECTIVE_KINDS for v in (1000, 600)
} | {f"label_ce/{dtype}/vocab_size={v}" for dtype in ("fp32", "fp64") for v in (None, 1000, 600)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("losses_tp") / "result.json"
    run_script("losses_tp_case.py", ["--out", str(out)], nproc=2)
    return json.loads(out.read_text())


def test_every_case_ran(results):
    assert set(results) == EXPECTED


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_tp2_equals_tp1(results, case):
    result = results[case]
    bad = {name: err for name, err in result["errors"].items() if not err <= result["tolerance"]}
    assert result["ok"] and not bad, f"{case}: errors above {result['tolerance']}: {bad}"
