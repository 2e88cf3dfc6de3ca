"""``benchmarks/gpu/real_model_study.py``: the GPU objective study, checked on the CPU.

- carry / receive: the GGUF split into two parts and reassembled on the other side, each part
  and the whole file checked by sha256; a damaged part is refused with one line;
- ``study --dry-run``: every stage at tiny sizes on a random Llama (the family of SmolLM2):
  on-policy responses, the calibration, the fresh and the fine-tuned condition for two
  objectives, the per-position held-out rows and the learning curves written to ``--out``.
  Checked against independent references: the held-out acceptance that the study computes
  (``tools/eval_acceptance.py``'s statistics) equals the trainer's own held-out evaluation
  of the same rows at T=1 (the loss's statistics, another code path); the fine-tuned runs
  start from the fresh ce head (their first curve point is its last); the fresh runs share
  the untrained head's first point; and ``real_model_report.py`` makes the tables with
  intervals from the returned files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from tests.helpers import forkserver
from tests.helpers.launch import REPO


def _load(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


study_tool = _load("real_model_study", REPO / "benchmarks" / "gpu" / "real_model_study.py")
files = sys.modules["real_model_files"]  # imported by the study script


def test_split_receive_reassemble(tmp_path, monkeypatch):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF" + bytes(range(256)) * 41)
    carry = (tmp_path / "c1", tmp_path / "c2")
    monkeypatch.setattr(files, "CARRY", carry)
    parts = files.split_file(src, [carry[0] / "model.gguf.part1", carry[1] / "model.gguf.part2"])
    assert sum(p["size"] for p in parts) == src.stat().st_size and abs(parts[0]["size"] - parts[1]["size"]) <= 1
    manifest = {"gguf_size": src.stat().st_size, "gguf_sha256": files.sha256_of(src), "parts": parts}
    for d in carry:
        (d / "manifest.json").write_text(json.dumps(manifest))
    for split in ("train", "heldout"):
        import gzip

        with gzip.open(carry[0] / f"{split}.jsonl.gz", "wb") as f:
            f.write(b'{"id": "a", "prompt": "hello"}\n')
    work = tmp_path / "work"
    study_tool.receive(study_tool.parse_args(["receive", "--part", "1", "--work", str(work)]))
    assert not (carry[0] / "model.gguf.part1").exists() and not (work / "model.gguf").exists()
    assert (work / "prompts" / "train.jsonl").read_bytes() == b'{"id": "a", "prompt": "hello"}\n'
    # A part damaged in transfer is refused, and stays where it is.
    good = (carry[1] / "model.gguf.part2").read_bytes()
    (carry[1] / "model.gguf.part2").write_bytes(good[:-1] + b"X")
    with pytest.raises(files.StudyError, match="damaged in transfer"):
        study_tool.receive(study_tool.parse_args(["receive", "--part", "2", "--work", str(work)]))
    (carry[1] / "model.gguf.part2").write_bytes(good)
    study_tool.receive(study_tool.parse_args(["receive", "--part", "2", "--work", str(work)]))
    assert (work / "model.gguf").read_bytes() == src.read_bytes()


def test_study_dry_run(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = forkserver.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "real_model_study.py"), "study",
                           "--dry-run", "--work", str(work),
                           "--out", str(out), "--objectives", "ce,e2e_tv"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert set(runs) == {"fresh_ce", "fresh_e2e_tv", "finetune_ce", "finetune_e2e_tv"}, summary.get("skipped")
    # Empty answers (EOS first) are dropped by the generator.
    responses = summary["responses"]
    assert 20 <= responses["train"]["responses"] <= 24 and 4 <= responses["heldout"]["responses"] <= 6
    steps = summary["steps_per_run"]
    for name, run in runs.items():
        assert run["steps"] == steps and run["tokens"] == steps * 4 * 64
        curve = run["curve"]
        assert curve[0]["tokens"] == 0 and curve[-1]["step"] == steps
        # The trainer's held-out evaluation (every row, T=1, the loss's statistics) against the
        # study's per-position rows (eval_acceptance's statistics) of the same model and rows.
        assert curve[-1]["alpha_rs"][0] == pytest.approx(run["metrics"]["1"]["alpha_rs_step1"], abs=1e-5)
    assert runs["fresh_ce"]["curve"][0] == runs["fresh_e2e_tv"]["curve"][0]  # the same untrained head
    ce_end = runs["fresh_ce"]["curve"][-1]
    for name in ("finetune_ce", "finetune_e2e_tv"):
        assert runs[name]["curve"][0]["alpha_rs"] == ce_end["alpha_rs"]
    positions = np.load(out / "positions_fresh.npz")
    a = positions["fresh_ce|1|alpha_rs"].astype(np.float64)
    chain = positions["fresh_ce|1|chain"]
    assert a[0][chain[0]].mean() == pytest.approx(runs["fresh_ce"]["metrics"]["1"]["alpha_rs_step1"], abs=2e-3)
    assert "study done" in (out / "study.log").read_text()
    # The report here: tables with intervals from the returned files, and the curves.
    report = _load("real_model_report", REPO / "benchmarks" / "gpu" / "real_model_report.py")
    text, data = report.build(out, num_boot=20)
    assert "| ce | 1 |" in text and "| e2e_tv | 0.7 |" in text and "Paired differences against ce" in text
    assert (out / "curves_fresh.png").stat().st_size > 0 and (out / "curves_finetune.png").stat().st_size > 0
    rows = data["csv"]["fresh_e2e_tv"]
    assert rows["alpha_rs_step1_T1"] == pytest.approx(runs["fresh_e2e_tv"]["metrics"]["1"]["alpha_rs_step1"], abs=2e-3)
    assert rows["alpha_rs_step1_T1_lo"] <= rows["alpha_rs_step1_T1"] <= rows["alpha_rs_step1_T1_hi"]
    _check_returned_heads(out, work, runs)


def _check_returned_heads(out, work, runs):
    """The heads the study returns (fine-tuned ce, the best other fine-tuned head) and real
    speculative decoding with them here (``real_model_speculative.py``)."""
    import torch

    ce, best = (torch.load(out / name, weights_only=True) for name in ("head_finetune_ce.pt", "head_best.pt"))
    assert ce["run"] == "finetune_ce" and best["run"] == "finetune_e2e_tv"  # the only other fine-tuned run
    assert best["metrics"]["1"]["accept_len_rs_g3"] == runs["finetune_e2e_tv"]["metrics"]["1"]["accept_len_rs_g3"]
    assert {v.dtype for v in ce["mtp"].values()} == {torch.bfloat16}
    assert any(not torch.equal(ce["mtp"][k], best["mtp"][k]) for k in ce["mtp"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = forkserver.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "real_model_speculative.py"),
                           "--from", str(out), "--model-dir", str(work / "megatron"),
                           "--prompts", str(work / "tiny_prompts" / "heldout.jsonl"), "--num-prompts", "2",
                           "--max-new-tokens", "6", "--temperatures", "1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for head in ("head_finetune_ce", "head_best"):
        r = json.loads((out / "speculative" / f"{head}_T1.json").read_text())
        assert r["num_prompts"] == 2 and r["gamma"] == 3 and 0 <= r["measured_accept_len"] <= 3
        # every verification emits its accepted drafts plus one token (the last may be cut at 6 tokens)
        assert r["tokens_per_target_forward"] <= 1 + r["measured_accept_len"] + 1e-9
        assert r["study"] == runs[r["run"]]["metrics"]["1"]
    assert "| finetune_e2e_tv | e2e_tv | 1 |" in (out / "speculative.md").read_text()
    report = _load("real_model_report", REPO / "benchmarks" / "gpu" / "real_model_report.py")
    report.main(["--from", str(out), "--num-boot", "5"])
    assert "Real speculative decoding with the returned heads" in (out / "RESULTS_gpu.md").read_text()


def test_plan_fits_the_time_or_drops_the_last_objectives():
    plan = dict(step_s=1.6, fixed_s=10.0, tokens_per_step=65536, target_tokens=5_000_000, min_steps=10)
    # 8 runs: (400 - 80) / (8 x 1.6) = 25 steps; 5M tokens would be 77.
    assert study_tool.fit_objectives(["ce", "kl", "e2e_tv", "e2e_nla"], left_s=400, **plan) == (
        25, ["ce", "kl", "e2e_tv", "e2e_nla"], [])
    assert sys.modules["real_model_runs"].plan_steps(left_s=10_000, num_runs=2, **plan) == 77  # capped by --target-tokens
    # 10 runs need 10 x (10 + 16) = 260 s at 10 steps: in 240 s the last objective goes, and the
    # other 8 runs get (240 - 80) / (8 x 1.6) = 12 steps.
    assert study_tool.fit_objectives(["ce", "kl", "e2e_tv", "e2e_nla", "e2e_lk"], left_s=240, **plan) == (
        12, ["ce", "kl", "e2e_tv", "e2e_nla"], ["e2e_lk"])
    with pytest.raises(files.StudyError, match="only 1 steps per run fit"):
        study_tool.fit_objectives(["ce", "kl", "e2e_tv"], left_s=50, **plan)


def test_objective_study_runs_the_tool_on_the_carried_model(tmp_path, monkeypatch):
    """``objective-study``: tools/objective_study.py on the dequantized GGUF and the carried prompts."""
    args = study_tool.parse_args(["objective-study", "--work", str(tmp_path), "--out", str(tmp_path / "o"),
                                  "--seeds", "0,1", "--tokens", "5000"])
    argv = study_tool.objective_study_argv(args, tmp_path / "hf")
    assert argv == ["--hf-dir", str(tmp_path / "hf"), "--prompts", str(tmp_path / "prompts"), "--work",
                    str(tmp_path / "objective_study"), "--out", str(tmp_path / "o"), "--device", "cuda", "--title",
                    files.SPEC.title, "--seeds", "0,1", "--tokens", "5000"]
    tool = _load("objective_study_tool_args", REPO / "tools" / "objective_study.py")
    parsed = tool.parse_args(argv)  # the tool accepts it
    assert parsed.seeds == "0,1" and parsed.tokens == 5000 and parsed.device == "cuda" and parsed.precision == "bf16"
    # without the reassembled GGUF: one line, before any work
    with pytest.raises(files.StudyError, match="model.gguf is missing"):
        study_tool.objective_study(args)
