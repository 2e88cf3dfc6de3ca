"""``benchmarks/gpu/real_model.sh``: the GPU objective study's command lines, checked on the CPU.

- carry / part 1 / part 2: the GGUF split into two parts and reassembled on the other side, each
  part and the whole file checked by sha256; a damaged part is refused with one line;
- which command each verb runs (a stand-in python3 records them), and the tool accepts them;
- ``smoke`` (what ``part 1 --smoke`` and the GPU script's study part run): the tool on a random
  tiny Llama, then the returned heads, checked against independent references: the runs chosen
  from the tool's records (ce, and the best other objective by held-out E[L](3) RS at T=1), their
  MTP weights against the kept checkpoints read by ``torch.distributed.checkpoint`` (not
  Megatron's loader); then real speculative decoding with them here (``benchmarks/speculative.py
  --heads``), and the same harness on a kept checkpoint against ``tools/speculative_generate.py``.

The tool itself is tested in tests/test_objective_study.py.
"""

from __future__ import annotations

import gzip
import hashlib
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


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("OUT", "WORK", "BEBOP_CACHE", "PYTHON"):
        env.pop(name, None)
    return env


def _tree(tmp_path, calls=None):
    """real_model.sh in a copy of the tree (no .whl/ of this checkout), a stand-in python3 that
    records its arguments (and does nothing else), the environment to run it with."""
    gpu = tmp_path / "tree" / "benchmarks" / "gpu"
    gpu.mkdir(parents=True)
    shutil.copy(GPU / "real_model.sh", gpu / "real_model.sh")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(f'#!/bin/sh\necho "$*" >> {calls or os.devnull}\n')
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'a GPU'\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    env = {**_env(), "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "WORK": str(tmp_path / "work")}
    return gpu / "real_model.sh", env


def test_carry_and_receive_reassemble(tmp_path):
    script, env = _tree(tmp_path)
    here = tmp_path / "here" / "smollm2-135m"
    (here / "prompts_gpu").mkdir(parents=True)
    gguf = b"GGUF" + bytes(range(256)) * 41
    (here / "model.gguf").write_bytes(gguf)  # already fetched: the stand-in python3 fetches nothing
    (here / "prompts_gpu" / "manifest.json").write_text("{}")
    for split in ("train", "heldout"):
        (here / "prompts_gpu" / f"{split}.jsonl").write_text(f'{{"id": "{split}", "prompt": "hello"}}\n')
    sh = lambda *a, **kw: subprocess.run(["bash", str(script), *a], env={**env, **kw}, capture_output=True,  # noqa: E731
                                         text=True, timeout=60)
    proc = sh("carry", BEBOP_CACHE=str(tmp_path / "here"))
    assert proc.returncode == 0, proc.stderr
    tree = script.parents[2]
    parts = [(tree / ".gpu_carry1" / "model.gguf.part1").read_bytes(), (tree / ".gpu_carry2" / "model.gguf.part2").read_bytes()]
    assert b"".join(parts) == gguf and abs(len(parts[0]) - len(parts[1])) <= 1
    assert gzip.decompress((tree / ".gpu_carry1" / "train.jsonl.gz").read_bytes()) == b'{"id": "train", "prompt": "hello"}\n'
    assert sh("part", "1").returncode == 0
    work = tmp_path / "work"
    assert not (tree / ".gpu_carry1" / "model.gguf.part1").exists() and (work / "parts" / "model.gguf.part1").is_file()
    assert (work / "prompts" / "heldout.jsonl").read_text() == '{"id": "heldout", "prompt": "hello"}\n'
    # A part damaged in transfer is refused with one line, and stays where it is.
    (tree / ".gpu_carry2" / "model.gguf.part2").write_bytes(parts[1][:-1] + b"X")
    proc = sh("part", "2")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: ") \
        and "damaged in transfer" in proc.stderr
    (tree / ".gpu_carry2" / "model.gguf.part2").write_bytes(parts[1])
    proc = sh("part", "2")
    assert proc.returncode == 0, proc.stderr
    cache = work / "cache" / "smollm2-135m"  # where tools/objective_study.py --model finds it (hub.fetch_gguf)
    assert (cache / "model.gguf").read_bytes() == gguf
    assert (cache / "model.gguf.sha256").read_text().strip() == hashlib.sha256(gguf).hexdigest()


def test_real_model_sh_runs_the_tool(tmp_path):
    """Each verb of real_model.sh: the receive and the study it starts, the tool accepts its options."""
    calls = tmp_path / "calls"
    script, env = _tree(tmp_path, calls)
    w, o = tmp_path / "work", tmp_path / "out"
    for n in (1, 2):  # both parts already received
        (w / "parts").mkdir(parents=True, exist_ok=True)
        (w / "parts" / f"model.gguf.part{n}").write_bytes(b"x")
    (w / "parts" / "SHA256SUMS").write_text(f"{hashlib.sha256(b'xx').hexdigest()}  model.gguf\n")

    def verbs(*args):
        calls.unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)
        return proc.returncode, calls.read_text().splitlines() if calls.exists() else [], proc.stderr

    tool = f"tools/objective_study.py --work {w}/objective_study --out {o} --device cuda --keep-checkpoints"
    full = f"--model smollm2-135m --prompts {w}/prompts --title SmolLM2-135M-Instruct"
    heads = f"benchmarks/gpu/real_model_heads.py {w}/objective_study {o}"
    rc, ran, _ = verbs("study", "--seeds", "0,1", "--device", "cpu")
    assert rc == 0 and ran[-2:] == [f"{tool} {full} --seeds 0,1 --device cpu", f"{heads} cpu"], ran
    parsed = _load("objective_study_tool_args", REPO / "tools" / "objective_study.py").parse_args(
        ran[-2].split()[1:])  # the tool accepts it
    assert parsed.model == "smollm2-135m" and parsed.device == "cpu" and parsed.seeds == "0,1" and parsed.keep_checkpoints
    assert verbs("part", "2", "--tokens", "1000")[1][-2:] == [f"{tool} {full} --tokens 1000", f"{heads} cuda"]
    rc, ran, _ = verbs("part", "1", "--smoke")
    assert rc == 0 and ran[-3].startswith(f"benchmarks/gpu/tiny_model.py {w}/smoke/tiny"), ran
    assert ran[-2].startswith(f"tools/objective_study.py --work {w}/smoke/objective_study --out {o}/smoke --device "
                              f"cuda --keep-checkpoints --hf-dir {w}/smoke/tiny/hf") and ran[-1].endswith("cuda")
    rc, ran, err = verbs("objective-study")
    assert rc == 2 and ran == [] and "error: unknown command 'objective-study'" in err


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


def test_smoke_returns_the_heads_and_they_decode_here(tmp_path):
    import torch

    work, out = tmp_path / "work", tmp_path / "out"
    proc = forkserver.run(["bash", str(GPU / "real_model.sh"), "smoke", "--device", "cpu"],
                          cwd=tmp_path, env={**_env(), "PYTHON": sys.executable, "WORK": str(work), "OUT": str(out)},
                          capture_output=True, text=True, timeout=600)
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
    prompts = work / "tiny" / "prompts" / "heldout.jsonl"
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
    ckpt = runs / "e2e_tv" / "seed0" / "ckpt"  # after another checkpoint: one process loads one after another
    proc = forkserver.run([sys.executable, str(REPO / "benchmarks" / "speculative.py"), "--checkpoint",
                           str(runs / "ce" / "seed0" / "ckpt"), str(ckpt), "--out", str(out / "spec_ckpt"), *common],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    proc = forkserver.run([sys.executable, str(REPO / "tools" / "speculative_generate.py"), "--checkpoint", str(ckpt),
                           "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "6", "--temperature", "1",
                           "--json", str(tmp_path / "tool.json")], env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert json.loads((out / "spec_ckpt" / "existing_ce_seed0_g3_T1.json").read_text())["loss"] == "ce"
    mine = json.loads((out / "spec_ckpt" / "existing_e2e_tv_seed0_g3_T1.json").read_text())
    tool = json.loads((tmp_path / "tool.json").read_text())
    for key in ("measured_accept_len", "num_verifications"):
        assert mine[key] == tool[key], key
    # the tool decodes batched (its default) and recomputes the forecast from scratch: equal to 1e-6
    for key in ("predicted_accept_len", "predicted_accept_len_decode"):
        assert mine[key] == pytest.approx(tool[key], rel=1e-6), key
    assert mine["study"] == records["e2e_tv"]["metrics"]["1"]["accept_len_rs_g3"]


def test_pick_runs_takes_ce_and_the_best_other(tmp_path):
    heads = _load("real_model_heads_pick", GPU / "real_model_heads.py")
    for objective, value in (("ce", 0.5), ("kl", 0.7), ("e2e_tv", 0.9), ("e2e_nla", 1.1), ("e2e_lk", 2.0)):
        for seed in (1, 2):
            folder = tmp_path / "runs" / "fresh" / objective / f"seed{seed}"
            (folder / "ckpt").mkdir(parents=True)
            (folder / "record.json").write_text(json.dumps({"metrics": {"1": {"accept_len_rs_g3": value + seed}}}))
            if objective != "e2e_nla":  # its checkpoint was not kept: not returned
                (folder / "ckpt" / "latest").write_text("iter_0000001")
    (tmp_path / "runs" / "fresh" / "e2e_lk" / "seed1" / "record.json").unlink()  # unfinished: not returned
    picked = heads.pick_runs(tmp_path)
    assert [name for name, _, _ in picked] == ["fresh_ce_seed1", "fresh_e2e_tv_seed1"]
    with pytest.raises(heads.StudyError, match="no finished run with a kept checkpoint"):
        heads.export_heads(tmp_path / "none", tmp_path)
