"""``tools/analyze_rl_acceptance.py`` on synthetic RL series with a known entropy slope and
a known injected mismatch (recovered within 5%), in wandb's CSV export format and as JSONL,
and its one-line errors for a missing column, too few steps, NaNs, acceptance outside [0, 1]
([0, gamma] for an accepted length) and a negative entropy."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "analyze_rl_acceptance.py"
SLOPE, MISMATCH, STEPS = -0.12, -0.08, 400


def load_tool():
    spec = importlib.util.spec_from_file_location("analyze_rl_acceptance", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic(seed=0, mismatch=MISMATCH):
    """Entropy wanders from the start (so b is identifiable) and rises late in the run;
    the mismatch ramps in over the second half."""
    rng = np.random.default_rng(seed)
    t = np.arange(STEPS)
    entropy = 1.2 + 0.25 * np.sin(t / 6.0) + 0.6 * np.clip((t - 150) / 250, 0, 1)
    injected = mismatch * np.clip((t - 200) / 150, 0, 1)
    accept = 0.85 + SLOPE * entropy + injected + rng.normal(0, 0.002, STEPS)
    return t, entropy, accept, injected


def write_wandb_csv(path, t, entropy, accept):
    run, other = "grpo-run-7", "other-run"
    header = ["Step", f"{run} - rollout/entropy", f"{run} - rollout/entropy__MIN", f"{run} - rollout/entropy__MAX",
              f"{run} - spec/alpha_1", f"{run} - spec/alpha_1__MIN", f"{run} - spec/alpha_1__MAX",
              f"{other} - spec/alpha_2"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for i in reversed(range(len(t))):  # unsorted on purpose
            w.writerow([t[i], entropy[i], entropy[i] - 0.1, entropy[i] + 0.1, accept[i], accept[i], accept[i], ""])


def test_recovers_slope_and_mismatch_from_wandb_csv(tmp_path):
    t, entropy, accept, injected = synthetic()
    path = tmp_path / "export.csv"
    write_wandb_csv(path, t, entropy, accept)
    out = tmp_path / "report"
    report = load_tool().main(["--input", str(path), "--entropy-col", "rollout/entropy", "--accept-col",
                               "spec/alpha_1", "--fit-fraction", "0.3", "--out-dir", str(out)])
    s = report["series"]["spec/alpha_1"]
    assert abs(s["slope"] - SLOPE) < 0.05 * abs(SLOPE), s
    window = report["fit_steps"]
    want_mismatch = injected[-window:].mean()
    assert abs(s["mismatch_part"] - want_mismatch) < 0.05 * abs(want_mismatch), s
    assert report["online_mtp_updates_indicated"] is True
    assert (out / "rl_acceptance.png").stat().st_size > 5000
    saved = json.loads((out / "rl_acceptance.json").read_text())
    assert saved["series"]["spec/alpha_1"]["slope"] == s["slope"] and "verdict" in saved


def test_entropy_only_drop_is_not_mismatch(tmp_path):
    t, entropy, accept, _ = synthetic(seed=1, mismatch=0.0)
    path = tmp_path / "steps.jsonl"
    with open(path, "w") as f:
        for i in range(STEPS):
            f.write(json.dumps({"step": int(t[i]), "H": entropy[i], "a1": accept[i], "a2": accept[i] - 0.1}) + "\n")
    report = load_tool().main(["--input", str(path), "--step-col", "step", "--entropy-col", "H", "--alpha-cols",
                               "a1", "a2", "--out-dir", str(tmp_path / "r")])
    assert set(report["series"]) == {"a1", "a2"}
    s = report["series"]["a1"]
    assert s["entropy_part"] < -0.05 and abs(s["mismatch_part"]) < 0.005, s
    assert report["online_mtp_updates_indicated"] is False


def run_cli(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


def one_line_error(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_errors(tmp_path):
    t, entropy, accept, _ = synthetic()
    path = tmp_path / "export.csv"
    write_wandb_csv(path, t, entropy, accept)
    msg = one_line_error(run_cli("--input", str(path), "--entropy-col", "rollout/entropy", "--accept-col", "nope",
                                 "--out-dir", str(tmp_path / "r")))
    assert str(path) in msg and "'nope' is not a column" in msg and "spec/alpha_1" in msg

    short = tmp_path / "short.csv"
    write_wandb_csv(short, t[:6], entropy[:6], accept[:6])
    msg = one_line_error(run_cli("--input", str(short), "--entropy-col", "rollout/entropy", "--accept-col",
                                 "spec/alpha_1", "--out-dir", str(tmp_path / "r")))
    assert "too few steps" in msg and str(short) in msg

    accept_nan = accept.copy()
    accept_nan[17] = np.nan
    holes = tmp_path / "holes.csv"
    write_wandb_csv(holes, t, entropy, accept_nan)
    args = ["--input", str(holes), "--entropy-col", "rollout/entropy", "--accept-col", "spec/alpha_1",
            "--out-dir", str(tmp_path / "r")]
    msg = one_line_error(run_cli(*args))
    assert "NaN" in msg and "--drop-missing" in msg
    ok = run_cli(*args, "--drop-missing")
    assert ok.returncode == 0 and "skipped 1 rows" in ok.stdout, ok.stderr

    msg = one_line_error(run_cli("--input", str(tmp_path / "missing.csv"), "--entropy-col", "x", "--accept-col", "y"))
    assert "missing.csv: file not found" in msg


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def series_rows(overrides):
    """Ten valid steps; ``overrides`` maps (column, row index) -> value."""
    rows = [{"step": i, "H": 1.0 + 0.1 * i, "a1": 0.7, "a2": 0.6, "len": 1.5} for i in range(10)]
    for (column, index), value in overrides.items():
        rows[index][column] = value
    return rows


def analyze_error(path, *flags) -> str:
    with pytest.raises(ValueError) as excinfo:
        load_tool().main(["--input", path, "--step-col", "step", "--entropy-col", "H", *flags,
                          "--out-dir", os.path.dirname(path)])
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_acceptance_outside_its_range_and_negative_entropy_are_refused(tmp_path):
    # Acceptance values 3..22 and entropy -5..14 were fitted and given a verdict.
    path = write_jsonl(tmp_path / "rate.jsonl", series_rows({("a1", 4): 3.0, ("a1", 6): 22.0}))
    msg = analyze_error(path, "--accept-col", "a1")
    assert msg == (f"{path}: column 'a1' has 3 at data row 5: outside [0, 1] for an acceptance rate; "
                   "pass --gamma N for an accepted length in [0, N]")
    path = write_jsonl(tmp_path / "alpha.jsonl", series_rows({("a2", 2): -0.1}))
    assert analyze_error(path, "--alpha-cols", "a1", "a2").endswith(
        "column 'a2' has -0.1 at data row 3: outside [0, 1] for an acceptance rate")
    path = write_jsonl(tmp_path / "entropy.jsonl", series_rows({("H", 7): -5.0}))
    assert analyze_error(path, "--accept-col", "a1").endswith(
        "column 'H' has -5 at data row 8: an entropy must be >= 0")
    path = write_jsonl(tmp_path / "length.jsonl", series_rows({("len", 1): 3.5}))
    assert analyze_error(path, "--accept-col", "len", "--gamma", "3").endswith(
        "column 'len' has 3.5 at data row 2: outside [0, 3] for an accepted length out of --gamma 3")


def test_an_accepted_length_within_gamma_is_read():
    from bebop_megatron.metrics.rl_drift import check_ranges

    tool = load_tool()
    args = tool.parse_args(["--input", "x", "--entropy-col", "H", "--accept-col", "len", "--gamma", "3"])
    table = {"step": np.arange(3.0), "entropy": np.array([0.0, 1.0, np.nan]), "len": np.array([0.0, 3.0, 2.9])}
    check_ranges(table, {"step": "step", "entropy": "H", "len": "len"}, args)  # NaN: left to --drop-missing

def test_a_binary_file_and_a_constant_column_are_named(tmp_path):
    """(issue 26 item 22) A binary input said only "'utf-8' codec can't decode byte ..." (csv's own
    errors gave a traceback); a constant entropy column was called "x"."""
    tool = load_tool()
    binary, huge = tmp_path / "plot.csv", tmp_path / "huge.csv"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    huge.write_text('Step,entropy\n1,"' + "7" * 200_000 + '"\n')  # not an export: csv's own error
    for path, message in ((binary, f"{binary}: not a UTF-8 text file (byte 1); give a CSV or JSONL export"),
                          (huge, f"{huge}: not a CSV file (field larger than field limit (131072)); give a CSV or "
                                 "JSONL export")):
        with pytest.raises(ValueError) as err:
            tool.main(["--input", str(path), "--entropy-col", "entropy", "--accept-col", "a"])
        assert str(err.value) == message
    t, _, accept, _ = synthetic()
    flat = tmp_path / "flat.csv"
    write_wandb_csv(flat, t, np.full(len(t), 1.25), accept)
    with pytest.raises(ValueError) as err:
        tool.main(["--input", str(flat), "--entropy-col", "rollout/entropy", "--accept-col", "spec/alpha_1",
                   "--out-dir", str(tmp_path / "r")])
    assert str(err.value) == (f"{flat}: --entropy-col 'rollout/entropy' is constant over the fit window (the first "
                              "0.2 of the steps): the entropy slope is undefined; raise --fit-fraction or check the "
                              "column")


def test_a_text_column_is_named_text_and_an_out_dir_file_is_refused(tmp_path):
    """(issue 36) A text column was called "empty or NaN" with a hint to --drop-missing, which then
    left no row; an --out-dir that is a file was a FileExistsError traceback after the analysis."""
    rows = series_rows({})
    for row in rows:
        row["H"] = "run-7"
    path = write_jsonl(tmp_path / "text.jsonl", rows)
    message = (f"{path}: column 'H' holds text, not numbers (10 of 10 rows, first 'run-7' at data row 1); pass a "
               "numeric column")
    assert analyze_error(path, "--accept-col", "a1") == message
    assert analyze_error(path, "--accept-col", "a1", "--drop-missing") == message
    good = write_jsonl(tmp_path / "good.jsonl", series_rows({}))
    taken = tmp_path / "taken"
    taken.write_text("mine\n")
    with pytest.raises(ValueError, match=rf"^--out-dir {taken} exists and is not a directory$"):
        load_tool().main(["--input", good, "--step-col", "step", "--entropy-col", "H", "--accept-col", "a1",
                          "--out-dir", str(taken)])
    assert taken.read_text() == "mine\n"
