"""``benchmarks/gpu/``: the GPU objective study's caller of ``tools/objective_study.py``, checked on the CPU.

- carry / receive: the GGUF split into two parts and reassembled on the other side, each part
  and the whole file checked by sha256; a damaged part is refused with one line;
- ``objective-study``: the tool's command line on the carried model and prompts;
- ``objective-study --dry-run`` (what ``real_model.sh part 1 --smoke`` runs on the GPU): the
  tool on a random tiny Llama, then the returned heads, checked against independent
  references: the runs chosen from the tool's records (ce, and the best other objective by
  held-out E[L](3) RS at T=1), their MTP weights against the kept checkpoints read by
  ``torch.distributed.checkpoint`` (not Megatron's loader); then real speculative decoding with
  them here (``benchmarks/speculative.py --heads``), and the same harness on a kept checkpoint
  against ``tools/speculative_generate.py``;
- ``real_model.sh``: which command each of its verbs runs.

The tool itself is tested in tests/test_objective_study.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import forkserver
from tests.helpers.launch import REPO

GPU = REPO / "benchmarks" / "gpu"


def _load(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


study_tool = _load("real_model_study", GPU / "real_model_study.py")
files = sys.modules["real_model_files"]  # imported by the study script


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    return env


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


def test_objective_study_runs_the_tool_on_the_carried_model(tmp_path):
    """``objective-study``: tools/objective_study.py on the dequantized GGUF and the carried prompts."""
    args = study_tool.parse_args(["objective-study", "--work", str(tmp_path), "--out", str(tmp_path / "o"),
                                  "--seeds", "0,1", "--tokens", "5000"])
    argv = study_tool.objective_study_argv(args, tmp_path / "hf", tmp_path / "prompts")
    assert argv == ["--hf-dir", str(tmp_path / "hf"), "--prompts", str(tmp_path / "prompts"), "--work",
                    str(tmp_path / "objective_study"), "--out", str(tmp_path / "o"), "--device", "cuda", "--title",
                    files.SPEC.title, "--keep-checkpoints", "--seeds", "0,1", "--tokens", "5000"]
    tool = _load("objective_study_tool_args", REPO / "tools" / "objective_study.py")
    parsed = tool.parse_args(argv)  # the tool accepts it
    assert parsed.seeds == "0,1" and parsed.tokens == 5000 and parsed.device == "cuda" and parsed.precision == "bf16"
    assert parsed.keep_checkpoints
    no_heads = study_tool.parse_args(["objective-study", "--no-heads", "--work", str(tmp_path)])
    assert "--keep-checkpoints" not in study_tool.objective_study_argv(no_heads, tmp_path, tmp_path)
    # the dry run's sizes come first: the caller's options win
    dry = study_tool.parse_args(["objective-study", "--dry-run", "--work", str(tmp_path), "--tokens", "512"])
    parsed = tool.parse_args(study_tool.objective_study_argv(dry, tmp_path / "hf", tmp_path / "prompts"))
    assert parsed.tokens == 512 and parsed.seq_length == 64 and parsed.objectives == "ce,e2e_tv"
    # without the reassembled GGUF: one line, before any work
    with pytest.raises(files.StudyError, match="model.gguf is missing"):
        study_tool.objective_study(args)


def _checkpoint_mtp(ckpt):
    """The MTP weights of a run checkpoint, read with torch.distributed.checkpoint alone, named as
    the model's MTP block names them (local layer spec)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    iteration = ckpt / (ckpt / "latest").read_text().strip()
    dcp_to_torch_save(iteration, ckpt.parent / "plain.pt")
    state = torch.load(ckpt.parent / "plain.pt", weights_only=False)
    return {k[len("mtp."):].replace("transformer_layer", "mtp_model_layer"): v for k, v in state.items()
            if k.startswith("mtp.") and torch.is_tensor(v)}


def test_dry_run_returns_the_heads_and_they_decode_here(tmp_path):
    import torch

    work, out = tmp_path / "work", tmp_path / "out"
    proc = forkserver.run([sys.executable, str(GPU / "real_model_study.py"), "objective-study", "--dry-run",
                           "--device", "cpu", "--work", str(work), "--out", str(out)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (out / "RESULTS.md").is_file() and (out / "results.csv").is_file()  # the tool's report
    # The heads: of the last condition (existing) and seed 0, ce and the best other objective.
    runs = work / "objective_study" / "runs" / "existing"
    records = {o: json.loads((runs / o / "seed0" / "record.json").read_text()) for o in ("ce", "e2e_tv")}
    assert sorted(p.name for p in out.glob("head_*.pt")) == ["head_existing_ce_seed0.pt",
                                                             "head_existing_e2e_tv_seed0.pt"]
    for objective, record in records.items():
        head = torch.load(out / f"head_existing_{objective}_seed0.pt", weights_only=True)
        assert head["run"] == f"existing_{objective}_seed0" and head["loss"] == objective
        assert head["metrics"] == record["metrics"]
        reference = _checkpoint_mtp(runs / objective / "seed0" / "ckpt")
        common = set(reference) & set(head["mtp"])
        assert len(common) >= 8, (sorted(reference), sorted(head["mtp"]))
        for k in common:
            assert head["mtp"][k].dtype == torch.bfloat16
            assert torch.equal(head["mtp"][k], reference[k].to(torch.bfloat16)), k
    # Real speculative decoding with them here, on the import the study made (benchmarks/speculative.py).
    prompts = work / "tiny_prompts" / "heldout.jsonl"
    common = ["--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "6", "--temperatures", "1"]
    proc = forkserver.run([sys.executable, str(REPO / "benchmarks" / "speculative.py"), "--heads", str(out),
                           "--backbone", str(work / "objective_study" / "megatron"), "--out", str(out / "spec"),
                           *common], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for objective, record in records.items():
        r = json.loads((out / "spec" / f"existing_{objective}_seed0_g3_T1.json").read_text())
        assert r["num_prompts"] == 2 and r["gamma"] == 3 and 0 <= r["measured_accept_len"] <= 3
        # every verification emits its accepted drafts plus one token (the last may be cut at 6 tokens)
        assert r["tokens_per_target_forward"] <= 1 + r["measured_accept_len"] + 1e-9
        assert r["study"] == record["metrics"]["1"]["accept_len_rs_g3"] and r["loss"] == objective
    assert "| existing_e2e_tv_seed0 | e2e_tv | 3 | 1 |" in (out / "spec" / "speculative.md").read_text()
    # The same harness on a kept run checkpoint equals tools/speculative_generate.py on it.
    ckpt = runs / "e2e_tv" / "seed0" / "ckpt"
    proc = forkserver.run([sys.executable, str(REPO / "benchmarks" / "speculative.py"), "--checkpoint", str(ckpt),
                           "--out", str(out / "spec_ckpt"), *common], env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    proc = forkserver.run([sys.executable, str(REPO / "tools" / "speculative_generate.py"), "--checkpoint", str(ckpt),
                           "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "6", "--temperature", "1",
                           "--json", str(tmp_path / "tool.json")], env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    mine = json.loads((out / "spec_ckpt" / "existing_e2e_tv_seed0_g3_T1.json").read_text())
    tool = json.loads((tmp_path / "tool.json").read_text())
    for key in ("measured_accept_len", "num_verifications", "predicted_accept_len", "predicted_accept_len_decode"):
        assert mine[key] == tool[key], key
    assert mine["study"] == records["e2e_tv"]["metrics"]["1"]["accept_len_rs_g3"]


def test_pick_runs_takes_ce_and_the_best_other(tmp_path):
    heads = _load("real_model_heads_pick", GPU / "real_model_heads.py")
    for objective, value in (("ce", 0.5), ("kl", 0.7), ("e2e_tv", 0.9), ("e2e_nla", 1.1)):
        folder = tmp_path / "runs" / "fresh" / objective / "seed1"
        (folder / "ckpt").mkdir(parents=True)
        (folder / "record.json").write_text(json.dumps({"metrics": {"1": {"accept_len_rs_g3": value}}}))
        if objective != "e2e_nla":  # its checkpoint was not kept: not returned
            (folder / "ckpt" / "latest").write_text("iter_0000001")
    picked = heads.pick_runs(tmp_path, conditions="fresh", seeds="1,2", objectives="ce,kl,e2e_tv,e2e_nla")
    assert [name for name, _, _ in picked] == ["fresh_ce_seed1", "fresh_e2e_tv_seed1"]
    with pytest.raises(files.StudyError, match="no finished run with a kept checkpoint"):
        heads.export_heads(tmp_path, tmp_path, conditions="existing", seeds="0", objectives="ce")


def test_real_model_sh_runs_the_tool(tmp_path):
    """Each verb of real_model.sh: the receive and the objective study it starts (a stand-in
    python3 records them; the script in a copy of the tree, so no .whl/ of this checkout is installed)."""
    gpu = tmp_path / "benchmarks" / "gpu"
    gpu.mkdir(parents=True)
    shutil.copy(GPU / "real_model.sh", gpu / "real_model.sh")
    calls = tmp_path / "calls"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'a GPU'\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    env.pop("PYTHON", None)

    def verbs(*args):
        calls.unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(gpu / "real_model.sh"), *args], env=env, capture_output=True, text=True,
                              timeout=60)
        return proc.returncode, calls.read_text().splitlines() if calls.exists() else [], proc.stderr

    script = "benchmarks/gpu/real_model_study.py"
    assert verbs("part", "1", "--smoke")[:2] == (0, [
        f"{script} receive --part 1",
        f"{script} objective-study --dry-run --device cuda --work .gpu_work/smoke --out {tmp_path / 'out'}/smoke"])
    assert verbs("part", "1")[:2] == (0, [f"{script} receive --part 1"])
    assert verbs("part", "2", "--seeds", "0,1")[:2] == (0, [f"{script} receive --part 2",
                                                            f"{script} objective-study --seeds 0,1"])
    assert verbs("study", "--tokens", "1000")[:2] == (0, [f"{script} objective-study --tokens 1000"])
    rc, ran, err = verbs("objective-study")
    assert rc == 2 and ran == [] and "error: unknown command 'objective-study'" in err
