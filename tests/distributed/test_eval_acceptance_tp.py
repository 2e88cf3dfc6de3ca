"""``tools/eval_acceptance.py`` under torchrun on 2 gloo ranks equals the single-process report:
TP=2 (vocabulary-parallel statistics, same simulated chains), TP=1 x DP=2 (rows split
over the ranks, sums reduced over the data-parallel group) and CP=2 (each row's forward split
over the ranks, the hidden states gathered back into whole rows: same statistics, decode-exact
forecast and simulated chains).

All in one 2-rank launch (tests/helpers/cli_batch.py: each call exactly as the tool's command
line): rank 0 alone, as a single process (a process group of its own), trains the tiny checkpoint
as tests/test_eval_acceptance.py does and writes the single-process report; then both ranks
write the 2-rank reports."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli_batch import run_batch
from tests.test_eval_acceptance import VALID

ANALYTIC = ("alpha_rs", "alpha_to", "top1", "entropy_target", "entropy_draft", "kl", "count", "accept_len_rs",
            "accept_len_to", "rs_win_fraction")
COMMON = ["--data", str(VALID), "--temperatures", "0.7", "1.0", "--max-rows", "12", "--micro-batch-size", "2",
          "--sim-positions", "32", "--sim-trials", "4", "--no-progress", "--device", "cpu"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_tp")
    ckpt = root / "run"

    def report(name, tp, alone=False, extra=()):
        return {"tool": "eval_acceptance", "alone": alone, "argv": [
            "--checkpoint", str(ckpt), "--out-dir", str(root / name), "--tensor-parallel", str(tp), *COMMON, *extra]}

    # tests/test_eval_acceptance.py's train_tiny_checkpoint: a random backbone, 3 steps
    train = {"tool": "pretrain_mtp", "alone": True, "argv": ["parallel.tensor=1", "train.steps=3",
                                                             f"save.dir={ckpt}", "model.backbone_init=random"]}
    cp2 = report("cp2", 1, extra=("--context-parallel", "2", "--cost-ratio", "0.1"))
    results = run_batch([train, report("single", 1, alone=True), report("tp2", 2), report("dp2", 1), cp2],
                        root / "batch", nproc=2)
    for result in results:
        assert result.returncode == 0, (result.args, result.stderr[-3000:])
    return {name: json.loads((root / name / "report.json").read_text()) for name in ("single", "tp2", "dp2", "cp2")}


def close(a, b, tol=1e-4):
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_two_ranks_equal_one(reports, layout):
    got, want = reports[layout], reports["single"]
    assert got["layout"]["tensor"] == (2 if layout == "tp2" else 1)
    assert got["layout"]["data"] == (2 if layout == "dp2" else 1)
    # The speed-up costs are measured on every layout (collective forwards under TP), from the same
    # E[L] the formula is applied to.
    costs = got["speedup"]["costs"]
    assert costs["source"] == "measured" and costs["target_ms"] > 0 and costs["draft_ms"] >= 0
    for tau, row in got["speedup"]["per_temperature"].items():
        e = got["per_temperature"][tau]["accept_len_rs"]
        assert close(row["speedup_rs"], [(1 + x) / (1 + g * costs["draft_ratio"]) for g, x in enumerate(e, 1)], 1e-9)
    for tau, entry in want["per_temperature"].items():
        other = got["per_temperature"][tau]
        bad = [k for k in ANALYTIC if not close(other[k], entry[k])]
        assert not bad, {k: (other[k], entry[k]) for k in bad}
        fit, other_fit = entry["entropy_fit"]["rs"]["slope"], other["entropy_fit"]["rs"]["slope"]
        assert (fit is None and other_fit is None) or abs(fit - other_fit) <= 1e-3 * max(1.0, abs(fit))
        if layout == "tp2":  # same positions, same random stream: the same simulated chains
            assert other["num_simulated_chains"] == entry["num_simulated_chains"]
            assert close(other["empirical_accept_len_rs"], entry["empirical_accept_len_rs"], 1e-9)
        else:  # each data-parallel rank simulates its own positions
            assert other["num_simulated_chains"] == 2 * entry["num_simulated_chains"]


DECODE = ("accept_len_decode_rs", "accept_len_decode_to", "expected_verifications_rs", "num_texts")


def test_context_parallel_equals_one_rank(reports):
    got, want = reports["cp2"], reports["single"]
    assert got["layout"]["context"] == 2 and got["layout"]["data"] == 1 and got["layout"]["tensor"] == 1
    assert got["num_positions"] == want["num_positions"]
    for tau, entry in want["per_temperature"].items():
        other = got["per_temperature"][tau]
        bad = [k for k in ANALYTIC + DECODE if not close(_list(other[k]), _list(entry[k]))]
        assert not bad, {k: (other[k], entry[k]) for k in bad}
        assert entry["accept_len_decode_rs"] and entry["num_texts"]
        # the whole rows on every CP rank, the same random stream: the single rank's simulated chains
        assert other["num_simulated_chains"] == entry["num_simulated_chains"]
        assert close(other["empirical_accept_len_rs"], entry["empirical_accept_len_rs"], 1e-6)


def _list(x):
    return x if isinstance(x, list) else [x]
