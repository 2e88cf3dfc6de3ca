"""HF -> Megatron import: the converted checkpoint's logits equal transformers' (float32).

For each family a tiny random model is built with transformers' config classes and saved
locally; ``tools/convert_from_hf.py`` converts it; the checkpoint is loaded at TP=1 and at a
2-rank layout (TP=2 for dense families; EP=2 and TP=2 with SP for Qwen3-MoE and GLM-4.5) and its
backbone logits compared with the transformers model's (relative 1e-4). Errors: unknown
architecture, missing files, shape mismatch: exit status 2 and one ``error:`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.convert_models import make_hf_model
from tests.helpers.launch import REPO, run_script

CLI = str(REPO / "tools" / "convert_from_hf.py")
# family -> layouts checked on 2 ranks, in one process (TP=1 there is TP=1 with DP=2)
LAYOUTS = {
    "llama": ["parallel.tensor=1", "parallel.tensor=2"],
    "qwen2": ["parallel.tensor=1", "parallel.tensor=2"],
    "qwen3": ["parallel.tensor=1", "parallel.tensor=2"],
    "mimo": ["parallel.tensor=1", "parallel.tensor=2"],
    "qwen3_moe": ["parallel.tensor=1", "parallel.expert=2", "parallel.tensor=2,parallel.sequence_parallel=true"],
    "glm4_moe": ["parallel.tensor=1", "parallel.expert=2", "parallel.tensor=2,parallel.sequence_parallel=true"],
}


def run_cli(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, CLI, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def convert(hf_dir, out, *extra) -> None:
    proc = run_cli(["--hf-dir", str(hf_dir), "--out", str(out), "--max-tensor-parallel", "2", "--no-progress",
                    *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]


def logits_errors(ckpt, hf_dir, family, layouts, out) -> list[float]:
    run_script("convert_logits_case.py", ["--ckpt", str(ckpt), "--hf-dir", str(hf_dir), "--family", family,
                                          "--out", str(out), *layouts], 2)
    return json.loads(out.read_text())["rel_err"]


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_import_logits_match_transformers(family, tmp_path):
    hf_dir = make_hf_model(family, tmp_path / "hf")
    ckpt = tmp_path / "megatron"
    convert(hf_dir, ckpt)
    assert (ckpt / "hf" / "tokenizer.json").is_file() and (ckpt / "hf" / "config.json").is_file()
    errors = logits_errors(ckpt, hf_dir, family, LAYOUTS[family], tmp_path / "result.json")
    assert len(errors) == len(LAYOUTS[family])
    for layout, err in zip(LAYOUTS[family], errors):
        assert err < 1e-4, (layout, err)


def _error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    # the progress bar (stderr, "%|") may precede the error
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_hf_model("qwen2", tmp_path_factory.mktemp("hf_qwen2"))


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_error_unknown_architecture(qwen2_dir, tmp_path):
    d = _copy(qwen2_dir, tmp_path / "hf")
    conf = json.loads((d / "config.json").read_text())
    conf["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(conf))
    assert "unknown architecture 'FalconForCausalLM'" in _error_line(run_cli(["--hf-dir", str(d), "--out", str(tmp_path / "o")]))


def test_error_missing_files(qwen2_dir, tmp_path):
    line = _error_line(run_cli(["--hf-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]))
    assert "not found" in line
    d = _copy(qwen2_dir, tmp_path / "hf")
    (d / "model.safetensors").unlink()
    assert "no *.safetensors" in _error_line(run_cli(["--hf-dir", str(d), "--out", str(tmp_path / "o")]))
    (d / "config.json").unlink()
    assert "config.json" in _error_line(run_cli(["--hf-dir", str(d), "--out", str(tmp_path / "o")]))


def test_error_missing_tensor_and_shape_mismatch(qwen2_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(qwen2_dir, tmp_path / "hf")
    weights = load_file(str(d / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(d / "model.safetensors"))
    line = _error_line(run_cli(["--hf-dir", str(d), "--out", str(tmp_path / "o")]))
    assert "model.layers.1.mlp.up_proj.weight is missing" in line
    conf = json.loads((d / "config.json").read_text())
    conf["num_key_value_heads"] = 4  # the stored k/v projections have 2 heads
    (d / "config.json").write_text(json.dumps(conf))
    _copy(qwen2_dir, tmp_path / "hf2")
    (tmp_path / "hf2" / "config.json").write_text(json.dumps(conf))
    line = _error_line(run_cli(["--hf-dir", str(tmp_path / "hf2"), "--out", str(tmp_path / "o")]))
    assert "shapes do not match config.json" in line or "shape mismatch" in line, line
