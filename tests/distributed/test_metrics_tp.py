"""``acceptance_stats`` with the vocabulary sharded over 2 gloo ranks (TP=2) and with the
positions split over 2 ranks (DP=2, ``dp_group``) equals the single-process call, in fp32
and fp64, with an argmax tie across shards and cut chains (``tests/helpers/metrics_tp_case.py``)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import run_script

EXPECTED = {f"{layout}/{dtype}" for layout in ("tp2", "dp2") for dtype in ("fp32", "fp64")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("metrics_tp") / "result.json"
    run_script("metrics_tp_case.py", ["--out", str(out)], nproc=2, timeout=120)
    return json.loads(out.read_text())


def test_every_case_ran(results):
    assert set(results) == EXPECTED


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_two_ranks_equal_one(results, case):
    result = results[case]
    bad = {name: err for name, err in result["errors"].items() if not err <= result["tolerance"]}
    assert result["ok"] and not bad, f"{case}: errors above {result['tolerance']}: {bad}"
