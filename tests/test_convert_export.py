"""Megatron -> HF export for vLLM and SGLang (``tools/convert_to_hf.py``): MiMo and GLM-4.5 formats.

Tiny random MiMo (Qwen2 backbone + one MTP layer, float32) and GLM-4.5 (dense first layer,
MoE with shared expert and sigmoid router, half RoPE, one NextN layer; bfloat16 with the
router bias in float32, as published) checkpoints, built with
transformers' classes, are imported with ``tools/convert_from_hf.py``. Checked:
- every format/target/--mtp-only combination writes exactly the names pinned below (vLLM's
  and SGLang's MiMo loaders), and ``--verify`` (on) passes: the independent forward's draft
  logits match the Megatron model's;
- HF -> Megatron -> HF reproduces every tensor of the source bit-exactly;
- the independent forward is sensitive to the projection's concat order (a swapped
  ``input_proj`` changes the draft logits), so the verification would catch it;
- export from checkpoints re-saved at PP=2 x TP=2 (GLM: with SP and EP=2) equals export from
  TP=1; export from a TP=2 training checkpoint (MTP weights only, plus ``--backbone``);
- unsupported format/target combinations and missing inputs: one clear error line.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.convert_models import make_hf_model
from tests.helpers.launch import REPO, run_script
from tests.test_convert_import import convert, run_cli as run_import_cli

EXPORT_CLI = str(REPO / "tools" / "convert_to_hf.py")
QWEN2_LAYER = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]
MIMO_MTP = ["token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight"]
MTP_KEYS = {f"model.mtp_layers.0.{n}" for n in QWEN2_LAYER + MIMO_MTP}
BACKBONE_KEYS = ({"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
                 | {f"model.layers.{i}.{n}" for i in range(2) for n in QWEN2_LAYER})
MIMO_EXPECTED = {  # (target, mtp_only) -> exact key set (vLLM's and SGLang's MiMoMTP loaders)
    ("vllm", False): BACKBONE_KEYS | MTP_KEYS,
    ("sglang", False): BACKBONE_KEYS | MTP_KEYS,
    ("vllm", True): MTP_KEYS | {"model.embed_tokens.weight", "lm_head.weight"},
    ("sglang", True): MTP_KEYS | {"model.embed_tokens.weight", "lm_head.weight"},
}
GLM_ATTN = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
            "self_attn.v_proj.bias", "self_attn.o_proj.weight"]
GLM_DENSE = GLM_ATTN + ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
GLM_MOE = (GLM_ATTN + ["mlp.gate.weight", "mlp.gate.e_score_correction_bias"]
           + [f"mlp.experts.{j}.{n}_proj.weight" for j in range(4) for n in ("gate", "up", "down")]
           + [f"mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")])
NEXTN = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"]
NEXTN_COPIES = ["shared_head.head.weight", "embed_tokens.weight"]
GLM_BACKBONE = ({"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
                | {f"model.layers.0.{n}" for n in GLM_DENSE} | {f"model.layers.1.{n}" for n in GLM_MOE})
GLM_LAYER2 = {f"model.layers.2.{n}" for n in GLM_MOE + NEXTN + NEXTN_COPIES}
GLM_EXPECTED = {  # vLLM: absolute index N=2 with the head/embedding copies; SGLang NextN: model.layers.0
    ("vllm", False): GLM_BACKBONE | GLM_LAYER2,
    ("sglang", False): GLM_BACKBONE | GLM_LAYER2,
    ("vllm", True): GLM_LAYER2,
    ("sglang", True): {f"model.layers.0.{n}" for n in GLM_MOE + NEXTN},
}
EXPECTED = {"mimo": MIMO_EXPECTED, "glm4_moe": GLM_EXPECTED}

def export(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, EXPORT_CLI, "--no-progress", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def exported(args: list[str]) -> subprocess.CompletedProcess:
    proc = export(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def load_dir(path) -> dict[str, torch.Tensor]:
    from bebop_megatron.convert.hf_io import read_all

    return read_all(str(path))


def _imported(root, family, dtype=torch.float32):
    hf_dir = make_hf_model(family, root / "hf", dtype=dtype)
    convert(hf_dir, root / "megatron")
    return root


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return _imported(tmp_path_factory.mktemp("mimo"), "mimo")


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return _imported(tmp_path_factory.mktemp("glm"), "glm4_moe", torch.bfloat16)  # as published


@pytest.mark.parametrize("fmt", ["mimo", "glm4_moe"])
@pytest.mark.parametrize("target", ["vllm", "sglang"])
@pytest.mark.parametrize("mtp_only", [False, True])
def test_export_key_set_and_verify(request, fmt, target, mtp_only, tmp_path):
    root = request.getfixturevalue("mimo" if fmt == "mimo" else "glm")
    out = tmp_path / "out"
    proc = exported(["--checkpoint", str(root / "megatron"), "--format", fmt, "--target", target,
                     "--out", str(out), *(["--mtp-only"] if mtp_only else [])])
    assert "verified:" in proc.stdout and "max_diff_mtp1" in proc.stdout, proc.stdout
    assert ("max_diff_backbone" in proc.stdout) == (not mtp_only)
    written = load_dir(out)
    assert set(written) == EXPECTED[fmt][(target, mtp_only)]
    import json

    conf = json.loads((out / "config.json").read_text())
    assert conf["num_nextn_predict_layers"] == 1
    if fmt == "mimo":
        assert conf["architectures"] == ["MiMoForCausalLM"] and conf["model_type"] == "mimo"
        assert conf["num_hidden_layers"] == 2
    elif target == "sglang" and mtp_only:
        assert conf["architectures"] == ["Glm4MoeForCausalLMNextN"] and conf["num_hidden_layers"] == 1
    else:
        assert conf["architectures"] == ["Glm4MoeForCausalLM"] and conf["num_hidden_layers"] == 2
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    assert ("speculative-use-rejection-sampling" if target == "sglang" else "probabilistic") in proc.stdout


@pytest.mark.parametrize("fmt", ["mimo", "glm4_moe"])
def test_round_trip_bit_exact(request, fmt, tmp_path):
    root = request.getfixturevalue("mimo" if fmt == "mimo" else "glm")
    exported(["--checkpoint", str(root / "megatron"), "--format", fmt, "--target", "vllm",
              "--out", str(tmp_path / "out"), "--no-verify"])
    source, written = load_dir(root / "hf"), load_dir(tmp_path / "out")
    assert set(written) == set(source)
    for name, t in source.items():
        assert written[name].dtype == t.dtype and torch.equal(written[name], t), name


def test_glm_two_mtp_layers(tmp_path):
    """Two NextN layers: vLLM export verified (absolute indices N, N+1); SGLang refused."""
    hf_dir = make_hf_model("glm4_moe", tmp_path / "hf", num_mtp=2)
    convert(hf_dir, tmp_path / "megatron")
    proc = exported(["--checkpoint", str(tmp_path / "megatron"), "--format", "glm4_moe", "--target", "vllm",
                     "--out", str(tmp_path / "o"), "--mtp-only"])
    assert "max_diff_mtp2" in proc.stdout
    names = set(load_dir(tmp_path / "o"))
    assert names == GLM_LAYER2 | {n.replace("layers.2.", "layers.3.") for n in GLM_LAYER2}
    line = _error_line(export(["--checkpoint", str(tmp_path / "megatron"), "--format", "glm4_moe", "--target",
                               "sglang", "--out", str(tmp_path / "o2")]))
    assert "SGLang loads one NextN layer; the checkpoint has 2" in line


def test_reference_forward_sees_swapped_halves(mimo, tmp_path):
    """The independent MiMo forward depends on the concat order: a Megatron-order projection
    (embedding half first) written unswapped would fail the verification."""
    import json

    from bebop_megatron.convert.verify import mimo_draft_logits

    config = json.loads((mimo / "hf" / "config.json").read_text())
    weights = load_dir(mimo / "hf")
    tokens = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(2))
    good = mimo_draft_logits(weights, config, hidden, tokens, 1)[0]
    w = weights["model.mtp_layers.0.input_proj.weight"]
    weights["model.mtp_layers.0.input_proj.weight"] = torch.cat(torch.chunk(w, 2, dim=1)[::-1], dim=1)
    bad = mimo_draft_logits(weights, config, hidden, tokens, 1)[0]
    assert (good - bad).abs().max() > 1e-2


LAYOUTS = {  # re-saved on 4 ranks; GLM's dense layer 0 and MoE layer 1 land on different stages
    "mimo": ["parallel.pipeline=2", "parallel.tensor=2"],
    "glm4_moe": ["parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2",
                 "parallel.expert_tensor=1"],
}


@pytest.mark.parametrize("fmt", ["mimo", "glm4_moe"])
def test_export_from_pp2_tp2_equals_tp1(request, fmt, tmp_path):
    root = request.getfixturevalue("mimo" if fmt == "mimo" else "glm")
    resaved = tmp_path / "resaved"
    run_script("convert_reshard_case.py", ["--ckpt", str(root / "megatron"), "--out", str(resaved), *LAYOUTS[fmt]], 4)
    outs = []
    for src, name in ((root / "megatron", "tp1"), (resaved, "pp2tp2")):
        exported(["--checkpoint", str(src), "--format", fmt, "--target", "vllm", "--out", str(tmp_path / name),
                  "--no-verify"])
        outs.append(load_dir(tmp_path / name))
    ref, got = outs
    assert set(ref) == set(got)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


def _error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def test_errors(mimo, tmp_path):
    ckpt = str(mimo / "megatron")
    base = ["--checkpoint", ckpt, "--out", str(tmp_path / "o")]
    assert "not supported yet" in _error_line(export([*base, "--format", "deepseek", "--target", "vllm"]))
    assert "needs a GLM-4.5 MoE checkpoint" in _error_line(export([*base, "--format", "glm4_moe", "--target", "vllm"]))
    assert "unknown --format 'eagle'" in _error_line(export([*base, "--format", "eagle", "--target", "vllm"]))
    assert "unknown --target 'trtllm'" in _error_line(export([*base, "--format", "mimo", "--target", "trtllm"]))
    assert "not found" in _error_line(export(["--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "o"),
                                              "--format", "mimo", "--target", "vllm"]))


def test_export_from_training_checkpoint(mimo, tmp_path):
    """The user's path: train on the imported backbone at TP=2 (2 ranks), export the MTP-only
    training checkpoint with ``--backbone``; verified, and the MTP weights did change."""
    save = tmp_path / "run"
    run_script(str(REPO / "examples" / "pretrain_mtp.py"), [
        "--config", str(mimo / "megatron" / "bebop_model.yaml"), "device=cpu", "parallel.tensor=2",
        f"model.init_checkpoint={mimo / 'megatron'}", "train.steps=2", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.seq_length=16", "train.lr=1e-2", f"save.dir={save}",
        "data.num_samples=16"], 2)
    line = _error_line(export(["--checkpoint", str(save), "--format", "mimo", "--target", "vllm",
                               "--out", str(tmp_path / "o")]))
    assert "holds only MTP weights" in line
    proc = exported(["--checkpoint", str(save), "--backbone", str(mimo / "megatron"), "--format", "mimo",
                     "--target", "vllm", "--mtp-only", "--out", str(tmp_path / "o")])
    assert "max_diff_mtp1" in proc.stdout
    trained, source = load_dir(tmp_path / "o"), load_dir(mimo / "hf")
    assert not torch.equal(trained["model.mtp_layers.0.input_proj.weight"],
                           source["model.mtp_layers.0.input_proj.weight"])
    assert torch.equal(trained["model.embed_tokens.weight"], source["model.embed_tokens.weight"])


def test_qwen2_copy_last_layer_as_mimo(tmp_path):
    """A model without MTP layers, warm-started with --mtp-init copy_last_layer and exported as
    MiMo: the MTP decoder layer is the last backbone layer, its final norm the model's."""
    hf_dir = make_hf_model("qwen2", tmp_path / "hf")
    convert(hf_dir, tmp_path / "megatron", "--mtp-init", "copy_last_layer")
    exported(["--checkpoint", str(tmp_path / "megatron"), "--format", "mimo", "--target", "sglang",
              "--out", str(tmp_path / "o")])
    w = load_dir(tmp_path / "o")
    for n in QWEN2_LAYER:
        assert torch.equal(w[f"model.mtp_layers.0.{n}"], w[f"model.layers.1.{n}"]), n
    assert torch.equal(w["model.mtp_layers.0.final_layernorm.weight"], w["model.norm.weight"])
    # tied embeddings: lm_head is written anyway, for vLLM's strict MiMoMTP loader
    assert torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])


def test_error_two_mtp_layers_for_sglang(tmp_path):
    hf_dir = make_hf_model("mimo", tmp_path / "hf", num_mtp=2)
    convert(hf_dir, tmp_path / "megatron")
    line = _error_line(export(["--checkpoint", str(tmp_path / "megatron"), "--format", "mimo", "--target",
                               "sglang", "--out", str(tmp_path / "o")]))
    assert "SGLang's MiMoMTP loads one MTP layer; the checkpoint has 2" in line


def test_error_format_family_mismatch(tmp_path):
    hf_dir = make_hf_model("qwen3", tmp_path / "hf")
    convert(hf_dir, tmp_path / "megatron")
    line = _error_line(export(["--checkpoint", str(tmp_path / "megatron"), "--format", "mimo", "--target", "vllm",
                               "--out", str(tmp_path / "o")]))
    assert "--format mimo needs a Qwen2-shaped dense model" in line
