"""``benchmarks/speculative.py``'s table and ``--publish`` (the benchmarks' one table writer,
``common.replace_marked_section``), on hand-made unit results: no decoding here (the harness
decodes in tests/test_gpu_real_model.py)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from types import SimpleNamespace

from tests.helpers.launch import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
spec = importlib.util.spec_from_file_location("speculative_harness", REPO / "benchmarks" / "speculative.py")
harness = importlib.util.module_from_spec(spec)
spec.loader.exec_module(harness)


def unit(head, speedup=None, decode=None):
    r = {"head": head, "loss": "e2e_tv", "gamma": 3, "temperature": 0.7, "num_prompts": 2, "max_new_tokens": 6,
         "measured_accept_len": 1.25, "ci95": [0.5, 2.0], "predicted_accept_len": 1.1, "predicted_ci95": [0.9, 1.3],
         "predicted_accept_len_at_starts": 1.2, "predicted_at_starts_ci95": [1.0, 1.4],
         "predicted_accept_len_decode": decode, "predicted_decode_ci95": [None, None], "study": None,
         "num_verifications": 4, "tokens_per_target_forward": 2.0}
    return r | ({"speedup": speedup} if speedup is not None else {})


def test_table_and_publish_replace_their_section(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS_CSV", str(tmp_path / "rows.csv"))
    args = SimpleNamespace(prompts="p/heldout.jsonl", max_new_tokens=6, seed=0, benchmark="bench_x",
                           publish=str(tmp_path / "RESULTS.md"))
    (tmp_path / "RESULTS.md").write_text("# Results\n\nkept\n")
    rows = [unit("fresh_ce_seed0"), unit("fresh_e2e_tv_seed0", speedup=1.5, decode=1.3)]
    text = harness.table(rows, args)
    lines = text.splitlines()
    assert lines[0] == harness.BEGIN and lines[-1] == harness.END
    assert "| fresh_ce_seed0 | e2e_tv | 3 | 0.7 | 1.250 [0.500, 2.000] | 1.100 [0.900, 1.300] | 1.200 [1.000, 1.400] " \
           "| n/a | n/a | 4 | 2.000 | n/a |" in lines
    assert "| 1.300 | n/a | 4 | 2.000 | 1.50x |" in lines[-3]
    harness.publish(rows, args, text)
    harness.publish(rows, args, text.replace("1.50x", "1.60x"))  # again: the section is replaced, not added
    body = (tmp_path / "RESULTS.md").read_text()
    assert body.startswith("# Results\n\nkept\n") and body.count(harness.BEGIN) == 1 and "1.60x" in body
    got = list(csv.DictReader(open(tmp_path / "rows.csv")))
    per_head = {h: {r["metric"]: float(r["value"]) for r in got[len(got) // 2:] if f"head={h}" in r["params"]}
                for h in ("fresh_ce_seed0", "fresh_e2e_tv_seed0")}
    assert per_head["fresh_ce_seed0"] == {"measured_ci_lo": 0.5, "measured_ci_hi": 2.0, "verifications": 4,
                                          "measured_accept_len": 1.25, "predicted_accept_len": 1.1,
                                          "predicted_accept_len_at_starts": 1.2, "tokens_per_target_forward": 2.0}
    assert per_head["fresh_e2e_tv_seed0"]["speedup"] == 1.5 and per_head["fresh_e2e_tv_seed0"][
        "predicted_accept_len_decode"] == 1.3
    assert all(r["benchmark"] == "bench_x" for r in got)
