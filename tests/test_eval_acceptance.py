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
              "entropy_fit", "entropy_bins", "rs_win_fraction", "accept_len_decode_rs", "accept_len_decode_to",
              "accept_len_decode_rs_ci95", "accept_len_decode_to_ci95", "expected_verifications_rs", "num_texts",
              "by_position", "decode_exact", "decode_exact_source"}
PLOTS = {"alpha_per_step", "accept_len_vs_gamma", "acceptance_vs_entropy", "accept_len_vs_temperature",
         "rs_vs_to_boundary", "speedup_vs_gamma", "acceptance_by_position"}


def PROMPTS12(d):
    """tiny_valid.jsonl's first 12 lines, the prompts of both --sample-prompts and speculative_generate."""
    path = d / "prompts12.jsonl"
    path.write_text("".join(VALID.read_text().splitlines(keepends=True)[:12]))
    return path


def SPEC_ARGV(checkpoint, d):
    """speculative_generate on the prompts of the --sample-prompts call."""
    return ["--checkpoint", checkpoint, "--prompts", PROMPTS12(d), "--gamma", "2", "--max-new-tokens", "24",
            "--json", d / "spec.json"]


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
    on_policy = d / "on_policy.jsonl"  # as tools/generate_responses.py records its sampling settings
    on_policy.write_text(VALID.read_text())
    (d / "on_policy.jsonl.settings.json").write_text(json.dumps({"model": "x", "temperature": 0.8, "top_p": 1.0}))
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
        "settings": ["--checkpoint", checkpoint, "--data", on_policy, "--temperatures", "0.8", "1.0", "--max-rows",
                     "2", "--cost-ratio", "0.1", "--no-progress", "--sim-positions", "0", "--out-dir", d / "r_settings"],
        "sample": ["--checkpoint", checkpoint, "--data", VALID, "--sample", "--max-new-tokens", "24", "--max-rows", "12",
                   "--temperatures", "1.0", "--gamma", "2", "--cost-ratio", "0.1", "--no-progress",
                   "--sim-positions", "0", "--out-dir", d / "r_sample"],
        "sample_prompts": ["--checkpoint", checkpoint, "--data", VALID, "--sample", "--sample-prompts", PROMPTS12(d),
                           "--max-new-tokens", "24", "--temperatures", "1.0", "--gamma", "2", "--no-speedup",
                           "--no-progress", "--sim-positions", "0", "--out-dir", d / "r_sample_prompts"],
        # a re-run into the same --out-dir, without the speed-up plot the first run wrote
        **{name: ["--checkpoint", checkpoint, "--data", VALID, "--max-rows", "4", "--sim-positions", "0",
                  "--no-progress", *extra, "--out-dir", d / "rerun"]
           for name, extra in (("first", ["--cost-ratio", "0.1"]), ("again", ["--no-speedup"]))},
    }
    (d / "rerun").mkdir()
    (d / "rerun" / "notes.txt").write_text("mine\n")
    results = run_batch([{"tool": "eval_acceptance", "argv": [str(a) for a in argv]} for argv in calls.values()]
                        + [{"tool": "speculative_generate", "argv": [str(a) for a in SPEC_ARGV(checkpoint, d)]}],
                        d / "batch")
    results, spec = results[:-1], results[-1]
    calls["speculative"] = None
    results.append(spec)
    return dict(zip(calls, results)), d


def test_decode_exact_flags_and_speedup_basis(runs):
    """The forecast is marked decode-exact only where the text was sampled at that temperature
    (the data file's .settings.json: T=0.8), and the speed-up says which E[L] it used."""
    results, d = runs
    proc = results["settings"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((d / "r_settings" / "report.json").read_text())
    e08, e1 = report["per_temperature"]["0.8"], report["per_temperature"]["1"]
    assert e08["decode_exact"] is True and "settings.json" in e08["decode_exact_source"]
    assert e1["decode_exact"] is False and "not at T=1" in e1["decode_exact_source"]
    rows = report["speedup"]["per_temperature"]
    assert rows["0.8"]["accept_len_used"] == "decode-exact" and rows["1"]["accept_len_used"].startswith("Eq. 12")
    want = [(1 + e) / (1 + g * 0.1) for g, e in enumerate(e08["accept_len_decode_rs"], start=1)]
    assert rows["0.8"]["speedup_rs"] == pytest.approx(want, rel=1e-12)
    for e in (e08, e1):
        lo, hi = e["accept_len_decode_rs_ci95"][-1]
        assert lo <= e["accept_len_decode_rs"][-1] <= hi
        # four equal buckets of train.seq_length: every chain in one of them, more than one bucket filled
        assert sum(e["by_position"]["count"]) == e["count"][0] and len(e["by_position"]["buckets"]) == 4
        assert sum(c > 0 for c in e["by_position"]["count"]) > 1
    assert "from the decode-exact E[L]" in proc.stdout and "from the Eq. 12 over every position E[L]" in proc.stdout


def test_sample_agrees_with_speculative_decoding(runs):
    """--sample at T=1 (continuations sampled from the backbone) forecasts what
    speculative_generate measures on the same prompts (--sample-prompts), within the two
    intervals pooled; without --sample-prompts the held-out data's own prompts are continued."""
    results, d = runs
    proc, spec = results["sample_prompts"], results["speculative"]
    assert results["sample"].returncode == 0, results["sample"].stderr[-3000:]
    own = json.loads((d / "r_sample" / "report.json").read_text())
    assert own["per_temperature"]["1"]["num_texts"] == 14  # the documents of the 12 packed rows (two hold two)
    assert own["per_temperature"]["1"]["decode_exact"] is True and own["sampled"]["max_new_tokens"] == 24
    assert own["speedup"]["per_temperature"]["1"]["accept_len_used"] == "decode-exact"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert spec.returncode == 0, spec.stderr[-3000:]
    report = json.loads((d / "r_sample_prompts" / "report.json").read_text())
    e = report["per_temperature"]["1"]
    measured = json.loads((d / "spec.json").read_text())
    assert e["decode_exact"] is True and e["num_texts"] == measured["num_prompts"]
    lo, hi = measured["ci95"]
    flo, fhi = e["accept_len_decode_rs_ci95"][-1]
    half = ((hi - lo) ** 2 + (fhi - flo) ** 2) ** 0.5 / 2
    assert abs(measured["measured_accept_len"] - e["accept_len_decode_rs"][-1]) < half, (measured, e)


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


def test_data_files_on_a_synthetic_language_run_are_warned_in_one_line(runs):
    """(issue 48 item 20) The tiny run was trained on the synthetic language; its report on chat
    JSONL (byte-tokenized) says so once, on stderr and in report.json; --data synthetic does not."""
    results, d = runs
    warnings = [line for line in results["report"].stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "trained on the synthetic language (no data.train_files)" in warnings[0]
    assert "the byte tokenizer" in warnings[0] and "--data synthetic" in warnings[0]
    assert json.loads((d / "report" / "report.json").read_text())["warnings"] == warnings
