"""``tools/eval_acceptance.py`` on a tiny trained checkpoint (3 steps of the default model).

- the report: every JSON key, per-temperature entries of the right lengths, simulated
  E[L] close to the analytic one, five non-empty PNGs of the expected size;
- the wiring: its statistics equal the training loss's (``mtp_loss``) on the same batches
  (``tests/helpers/eval_acceptance_case.py``);
- a missing or damaged checkpoint (truncated shard or ``.metadata``) and a malformed dataset
  line: one ``error:`` line naming the path (and line; for a damaged checkpoint the newest
  intact one before it), exit status 2, no traceback;
- data with no valid MTP position (every response truncated away; or none in the --max-rows
  evaluated): one ``error:`` line, no report.

Every invocation of the tool runs in one process (``tests/helpers/cli_batch.py``: each call
exactly as the tool's ``__main__`` runs it, its stdout, stderr and exit status kept apart), set
up once by the ``runs`` fixture: a process per call would import torch and Megatron-Core again.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from tests.helpers.cli_batch import run_batch
from tests.helpers.launch import REPO, run_script

TOOL = REPO / "tools" / "eval_acceptance.py"  # also run under torchrun by tests/distributed/test_eval_acceptance_tp.py
VALID = REPO / "examples" / "data" / "tiny_valid.jsonl"
TOP_KEYS = {"checkpoint", "data", "num_rows", "num_positions", "num_steps", "gamma", "layout", "temperatures",
            "reference_temperature", "per_temperature", "speedup", "plots"}
ENTRY_KEYS = {"alpha_rs", "alpha_to", "top1", "entropy_target", "entropy_draft", "kl", "count", "accept_len_rs",
              "accept_len_to", "empirical_accept_len_rs", "empirical_accept_len_to", "num_simulated_chains",
              "entropy_fit", "entropy_bins", "rs_win_fraction"}
PLOTS = {"alpha_per_step", "accept_len_vs_gamma", "acceptance_vs_entropy", "accept_len_vs_temperature",
         "rs_vs_to_boundary", "speedup_vs_gamma"}


def train_tiny_checkpoint(save_dir: Path) -> Path:
    # A random backbone: these tests are about the report's wiring, and the fitted quick-start
    # backbone is tested (at a tiny size) in tests/test_synthetic_backbone.py.
    run_script(str(REPO / "examples" / "pretrain_mtp.py"),
               ["parallel.tensor=1", "train.steps=3", f"save.dir={save_dir}", "model.backbone_init=random"], nproc=1)
    return save_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return train_tiny_checkpoint(tmp_path_factory.mktemp("eval_ckpt") / "run")


LONG_PROMPT = {"prompt": "count the cats in the big red barn and then say how many " * 2, "response": "three."}
DAMAGE = {"__0_0.distcp": "__0_0.distcp is truncated (", ".metadata": ".metadata is unreadable or truncated ("}


def damaged_copy(checkpoint: Path, run: Path, name: str) -> Path:
    """A copy of the run whose newest checkpoint has ``name`` cut in half, with an older intact one."""
    shutil.copytree(checkpoint, run)
    newest = run / (run / "latest").read_text().strip()
    shutil.copytree(newest, run / "iter_0000001")  # an older, intact checkpoint
    data = (newest / name).read_bytes()
    (newest / name).write_bytes(data[: len(data) // 2])
    return newest


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    """``(results, dir)``: every invocation of the tool in this file, run once in one process."""
    d = tmp_path_factory.mktemp("eval_runs")
    bad = d / "bad.jsonl"
    lines = VALID.read_text().splitlines()
    bad.write_text("\n".join(lines[:2] + ['{"prompt": "x", "response": '] + lines[2:4]) + "\n")
    (d / "nodata_run").mkdir()
    (d / "nodata_run" / "metadata.json").write_text("{}")  # enough for the checkpoint check, which comes first
    (d / "truncated.jsonl").write_text("\n".join(json.dumps(LONG_PROMPT) for _ in range(4)) + "\n")
    (d / "mixed.jsonl").write_text(json.dumps(LONG_PROMPT) + "\n" + VALID.read_text())
    for name in DAMAGE:
        damaged_copy(checkpoint, d / f"damaged{name}", name)
    calls = {
        "report": ["--checkpoint", checkpoint, "--data", VALID, "--temperatures", "0.8", "1.0", "--gamma", "2",
                   "--max-rows", "12", "--sim-positions", "64", "--sim-trials", "8", "--out-dir", d / "report",
                   "--no-progress", "--positions-out", d / "not_yet" / "positions.pt"],  # its directory is created
        "missing_checkpoint": ["--checkpoint", d / "no_such_run", "--data", VALID, "--out-dir", d / "r"],
        "missing_data": ["--checkpoint", d / "nodata_run", "--data", VALID, d / "missing.jsonl", "--out-dir", d / "r"],
        "malformed": ["--checkpoint", checkpoint, "--data", bad, "--out-dir", d / "r"],
        **{f"damaged{name}": ["--checkpoint", d / f"damaged{name}", "--data", VALID, "--out-dir", d / "r"]
           for name in DAMAGE},
        "truncated": ["--checkpoint", checkpoint, "--data", d / "truncated.jsonl", "--out-dir", d / "r_truncated"],
        "mixed": ["--checkpoint", checkpoint, "--data", d / "mixed.jsonl", "--max-rows", "1", "--no-speedup",
                  "--out-dir", d / "r_mixed"],
        # a re-run into the same --out-dir, without the speed-up plot the first run wrote
        **{name: ["--checkpoint", checkpoint, "--data", VALID, "--max-rows", "4", "--sim-positions", "0",
                  "--no-progress", *extra, "--out-dir", d / "rerun"]
           for name, extra in (("first", ["--cost-ratio", "0.1"]), ("again", ["--no-speedup"]))},
    }
    (d / "rerun").mkdir()
    (d / "rerun" / "notes.txt").write_text("mine\n")
    results = run_batch([{"tool": "eval_acceptance", "argv": [str(a) for a in argv]} for argv in calls.values()],
                        d / "batch")
    return dict(zip(calls, results)), d


def png_size(path: Path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def test_report_writes_every_key_and_plot(runs):
    results, d = runs
    proc, out, positions = results["report"], d / "report", d / "not_yet" / "positions.pt"
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert TOP_KEYS <= set(report)
    assert report["gamma"] == 2 and report["num_steps"] == 3 and report["num_rows"] == 12
    assert set(report["per_temperature"]) == {"0.8", "1"}
    for entry in report["per_temperature"].values():
        assert ENTRY_KEYS <= set(entry)
        assert len(entry["alpha_rs"]) == len(entry["alpha_to"]) == 3
        assert len(entry["accept_len_rs"]) == len(entry["empirical_accept_len_rs"]) == 2
        assert entry["num_simulated_chains"] == 64 * 8
        assert all(0 <= a <= 1 for a in entry["alpha_rs"] + entry["alpha_to"])
        for g in range(2):  # 512 chains: the simulated mean is within ~0.1 of the analytic one
            assert abs(entry["empirical_accept_len_rs"][g] - entry["accept_len_rs"][g]) < 0.3
        assert {"rs", "to"} <= set(entry["entropy_fit"])
    # The per-position rows average to the report's per-step means.
    import torch

    rows = torch.load(positions)
    assert set(rows) == {"0.8", "1"}
    for tau, entry in report["per_temperature"].items():
        chain = rows[tau]["chain"].bool()
        assert chain.sum(-1).tolist() == entry["count"]
        for key in ("alpha_rs", "alpha_to", "entropy_target"):
            means = ((rows[tau][key].double() * chain).sum(-1) / chain.sum(-1)).tolist()
            assert means == pytest.approx(entry[key], rel=1e-5), key
    # The speed-up model, measured here: (1 + E[L](g)) / (1 + g c_draft/c_target), the best g recommended.
    speedup = report["speedup"]
    costs = speedup["costs"]
    assert costs["source"] == "measured" and costs["target_ms"] > 0 and costs["draft_ms"] >= 0
    assert costs["draft_ratio"] == pytest.approx(costs["draft_ms"] / costs["target_ms"]) and costs["overhead"] == 0
    assert "one sequence of 64 tokens" in costs["method"] and "no KV cache" in costs["method"]
    assert speedup["max_gamma"] == 2 and "--gamma 3" in speedup["note"]
    for tau, row in speedup["per_temperature"].items():
        for which in ("rs", "to"):
            e = report["per_temperature"][tau][f"accept_len_{which}"]
            want = [(1 + e[g - 1]) / (1 + g * costs["draft_ratio"]) for g in (1, 2)]
            assert row[f"speedup_{which}"] == pytest.approx(want, rel=1e-12)
            best = max((0, 1.0), *((g, s) for g, s in zip((1, 2), want)), key=lambda gs: gs[1])
            assert (row[f"best_gamma_{which}"], row[f"best_speedup_{which}"]) == (best[0], pytest.approx(best[1]))
    assert "recommended gamma" in proc.stdout
    assert set(report["plots"]) == PLOTS
    for path in report["plots"].values():
        width, height = png_size(Path(path))
        assert width >= 500 and height >= 350 and Path(path).stat().st_size > 10_000, path


def test_statistics_equal_the_training_loss(checkpoint, tmp_path):
    out = tmp_path / "case.json"
    run_script("eval_acceptance_case.py", ["--checkpoint", str(checkpoint), "--data", str(VALID), "--out", str(out)],
               nproc=1)
    result = json.loads(out.read_text())
    assert result["count"][0] > 100
    bad = {k: e for k, e in result["errors"].items() if not e < 1e-5}
    assert not bad, bad


def error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_missing_checkpoint_is_one_line(runs):
    results, d = runs
    line = error_line(results["missing_checkpoint"])
    assert f"checkpoint not found: {d / 'no_such_run'}" in line


def test_an_error_every_rank_finds_is_printed_once(tmp_path, monkeypatch, capsys):
    """(issue 26 item 23) Under 2 ranks each error was printed twice ("error: ..." and
    "error: [rank 1] ..."): the tool's checks are the same on every rank, rank 0 prints them."""
    import importlib.util

    from bebop_megatron.cli import run_cli

    spec = importlib.util.spec_from_file_location("eval_acceptance", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    missing = tmp_path / "no_such_run"
    printed = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        with pytest.raises(SystemExit) as exc:
            run_cli(lambda: tool.main(["--checkpoint", str(missing), "--data", str(VALID)]))
        assert exc.value.code == 2
        printed.append(capsys.readouterr().err)
    assert printed == [f"error: checkpoint not found: {missing} (expected a save.dir with 'latest' or an iter_N "
                       "directory)\n", ""]


def test_missing_data_names_the_flag(runs):
    results, d = runs
    missing = d / "missing.jsonl"
    line = error_line(results["missing_data"])
    assert line == f"error: --data[1]={str(missing)!r}: no such file (nor {missing}.bin/.idx)"


def test_malformed_dataset_line_names_path_and_line(runs):
    results, d = runs
    line = error_line(results["malformed"])
    assert f"{d / 'bad.jsonl'}:3:" in line


@pytest.mark.parametrize("name, problem", DAMAGE.items())
def test_damaged_checkpoint_is_one_line_naming_the_intact_one(runs, name, problem):
    results, d = runs
    run = d / f"damaged{name}"
    newest = run / (run / "latest").read_text().strip()
    line = error_line(results[f"damaged{name}"])
    assert line.startswith(f"error: checkpoint {newest} is damaged: {problem}"), line
    assert line.endswith(f"; the newest intact checkpoint before it is {run / 'iter_0000001'}: pass --checkpoint "
                         f"{run / 'iter_0000001'}"), line


def test_data_without_a_valid_position_is_refused(runs):
    """Prompts longer than the row (seq_length 64, byte tokens): every response is truncated away, so
    there is no acceptance to measure; refused before the model is loaded, not reported as alpha 0."""
    results, d = runs
    line = error_line(results["truncated"])
    assert line.startswith("error: --data: no position to evaluate the MTP heads on: every trained"), line
    assert not (d / "r_truncated" / "report.json").exists()
    # some rows have positions, the ones evaluated (--max-rows 1: the first, a truncated document) do not
    line = error_line(results["mixed"])
    assert "the 1 rows evaluated (--max-rows) hold no position" in line, line
    assert not (d / "r_mixed" / "report.json").exists()


def test_a_rerun_replaces_the_earlier_reports_files(runs):
    """(issue 36 item 10) A re-run into an --out-dir left the earlier run's plots beside the new
    report.json; now the report's own files are replaced, the user's kept."""
    results, d = runs
    for name in ("first", "again"):
        assert results[name].returncode == 0, results[name].stderr[-3000:]
    report = json.loads((d / "rerun" / "report.json").read_text())
    assert report["speedup"] is None and set(report["plots"]) == PLOTS - {"speedup_vs_gamma"}
    assert sorted(p.name for p in (d / "rerun").iterdir()) == sorted(
        ["notes.txt", "report.json", *(f"{name}.png" for name in report["plots"])])
    assert (d / "rerun" / "notes.txt").read_text() == "mine\n"
