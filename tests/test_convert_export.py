"""Megatron -> HF export for vLLM and SGLang (``tools/convert_to_hf.py``): MiMo and GLM-4.5 formats.

Tiny random MiMo (Qwen2 backbone + one MTP layer, float32) and GLM-4.5 (dense first layer,
MoE with shared expert and sigmoid router, half RoPE, one NextN layer; bfloat16 with the
router bias in float32, as published) checkpoints, built with
transformers' classes, are imported with ``tools/convert_from_hf.py``. Checked:
- every format/target/--mtp-only combination writes exactly the names pinned below (vLLM's
  and SGLang's MiMo loaders), and ``--verify`` (on) passes: the independent forward's draft
  logits match the Megatron model's for K=3 steps through the one reused MTP layer (the
  imported models' ``mtp.num_steps``), and for K=2 through GLM's two NextN layers;
- the step-to-step hand-off: both engines' default is post-norm (current vLLM for GLM since
  PR #45895); ``--vllm-handoff pre_norm`` (vLLM before it) verifies heads recorded as trained
  with ``mtp.next_step_input=pre_norm`` and fails at step 2, naming step and hand-offs, for
  heads trained post-norm (and the reverse), while step 1 matches; refused for MiMo and SGLang;
- HF -> Megatron -> HF reproduces every tensor of the source bit-exactly;
- the independent forward is sensitive to the projection's concat order (a swapped
  ``input_proj`` changes the draft logits), so the verification would catch it;
- export from the GLM checkpoint re-saved at PP=2 x TP=2 with SP and EP=2 equals export from
  TP=1; export from a TP=2 training checkpoint (MTP weights only, plus ``--backbone``), and
  ``tools/speculative_generate.py`` on the full export decodes exactly as on that checkpoint;
- unsupported format/target combinations and missing inputs: one clear error line.

The conversions and exports that need no multi-rank run execute in one process (the
``batch`` fixture, tests/helpers/cli_batch.py), each exactly as the tool's command line; those
of the checkpoints written by multi-rank runs after the training run, in its launch (the
``launched`` fixture).
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests.helpers.cli_batch import run_batch
from tests.helpers.convert_models import make_hf_model
from tests.helpers.handoff_checks import failed_at_step_2
from tests.helpers.launch import REPO

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
    ("sglang", True): MTP_KEYS | {"model.embed_tokens.weight", "lm_head.weight"},
}  # ("vllm", True): refused (test_mimo_mtp_only_refused_for_vllm)
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

def ok(proc) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    return proc


def load_dir(path) -> dict[str, torch.Tensor]:
    from bebop_megatron.convert.hf_io import read_all

    return read_all(str(path))


def _error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


COMBOS = [(target, mtp_only) for target in ("vllm", "sglang") for mtp_only in (False, True)]


def single_process_calls(root) -> tuple[list[str], list[dict]]:
    """``(names, calls)``: every conversion and export of this module that needs no multi-rank
    run (tests/helpers/cli_batch.py calls), the models they start from written under
    ``root / NAME / "hf"`` (their imports go to ``root / NAME / "megatron"``)."""
    calls, names = [], []

    def add(name, tool, argv):
        names.append(name)
        calls.append({"tool": tool, "argv": ["--no-progress", *argv]})

    models = {  # name -> (family, make_hf_model options, convert_from_hf options)
        "mimo": ("mimo", {}, []),
        "glm": ("glm4_moe", {"dtype": torch.bfloat16}, []),  # bf16 with the router bias in fp32, as published
        "glm_2mtp": ("glm4_moe", {"num_mtp": 2}, []),
        "mimo_2mtp": ("mimo", {"num_mtp": 2}, []),
        "qwen2_copy": ("qwen2", {}, ["--mtp-init", "copy_last_layer"]),
        "qwen3": ("qwen3", {}, []),
    }
    for name, (family, options, extra) in models.items():
        hf_dir = make_hf_model(family, root / name / "hf", **options)
        add(f"import/{name}", "convert_from_hf", ["--hf-dir", str(hf_dir), "--out", str(root / name / "megatron"),
                                                  "--max-tensor-parallel", "2", *extra])

    def export_call(name, model, fmt, target, *extra):
        add(name, "convert_to_hf", ["--checkpoint", str(root / model / "megatron"), "--format", fmt, "--target",
                                    target, "--out", str(root / "out" / name.replace("/", "_")), *extra])

    for fmt, model in (("mimo", "mimo"), ("glm4_moe", "glm")):
        for target, mtp_only in COMBOS:
            export_call(f"{fmt}/{target}/{mtp_only}", model, fmt, target, *(["--mtp-only"] if mtp_only else []))
        export_call(f"{fmt}/round_trip", model, fmt, "vllm", "--no-verify")
    export_call("glm_2mtp/vllm", "glm_2mtp", "glm4_moe", "vllm", "--mtp-only")
    export_call("glm_2mtp/sglang", "glm_2mtp", "glm4_moe", "sglang")
    export_call("mimo_2mtp/sglang", "mimo_2mtp", "mimo", "sglang")
    export_call("mimo_2mtp/vllm", "mimo_2mtp", "mimo", "vllm", "--mtp-only")
    export_call("glm_2mtp/vllm_k3", "glm_2mtp", "glm4_moe", "vllm", "--mtp-only", "--num-speculative-tokens", "3")
    export_call("qwen2_copy/sglang", "qwen2_copy", "mimo", "sglang")
    export_call("qwen3/mimo", "qwen3", "mimo", "vllm")
    # hand-offs: the imported GLM model is recorded post_norm (the default); glm_pre is the same
    # weights recorded as trained with mtp.next_step_input=pre_norm
    names.append("record/glm_pre")
    calls.append({"tool": "record_mtp", "argv": [str(root / "glm" / "megatron"), str(root / "glm_pre" / "megatron"),
                                                 "next_step_input=pre_norm"]})
    legacy = ("--vllm-handoff", "pre_norm")
    export_call("handoff/mimo_legacy", "mimo", "mimo", "vllm", *legacy)
    export_call("handoff/glm_legacy_on_post", "glm", "glm4_moe", "vllm", "--mtp-only", *legacy)
    export_call("handoff/glm_legacy_on_post_k1", "glm", "glm4_moe", "vllm", "--mtp-only", *legacy,
                "--num-speculative-tokens", "1")
    export_call("handoff/glm_pre_legacy", "glm_pre", "glm4_moe", "vllm", *legacy)
    export_call("handoff/glm_pre_vllm", "glm_pre", "glm4_moe", "vllm", "--mtp-only")
    export_call("handoff/glm_pre_sglang", "glm_pre", "glm4_moe", "sglang", "--mtp-only")
    export_call("handoff/glm_sglang_legacy", "glm", "glm4_moe", "sglang", *legacy)
    base = ["--checkpoint", str(root / "mimo" / "megatron"), "--out", str(root / "out" / "error")]
    add("error/deepseek", "convert_to_hf", [*base, "--format", "deepseek", "--target", "vllm"])
    add("error/glm_on_mimo", "convert_to_hf", [*base, "--format", "glm4_moe", "--target", "vllm"])
    add("error/format", "convert_to_hf", [*base, "--format", "eagle", "--target", "vllm"])
    add("error/target", "convert_to_hf", [*base, "--format", "mimo", "--target", "trtllm"])
    add("error/missing", "convert_to_hf", ["--checkpoint", str(root / "none"), "--out", str(root / "out" / "error"),
                                           "--format", "mimo", "--target", "vllm"])
    return names, calls


@pytest.mark.parametrize("fmt", ["mimo", "glm4_moe"])
@pytest.mark.parametrize("target", ["vllm", "sglang"])
@pytest.mark.parametrize("mtp_only", [False, True])
def test_export_key_set_and_verify(batch, fmt, target, mtp_only):
    import json

    root, results = batch
    name = f"{fmt}/{target}/{mtp_only}"
    if (fmt, target, mtp_only) == ("mimo", "vllm", True):
        pytest.skip("refused: test_mimo_mtp_only_refused_for_vllm")
    proc = ok(results[name])
    out = root / "out" / name.replace("/", "_")
    # K=3 draft steps (the imported model's mtp.num_steps) through the one reused MTP layer
    assert "verified:" in proc.stdout and "max_diff_mtp3" in proc.stdout, proc.stdout
    assert "3 draft step(s) through 1 MTP layer(s), each handing the next the post-norm state" in proc.stdout
    assert ("max_diff_backbone" in proc.stdout) == (not mtp_only)
    written = load_dir(out)
    assert set(written) == EXPECTED[fmt][(target, mtp_only)]
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
    assert ("--speculative-num-steps 3 " if target == "sglang" else '"num_speculative_tokens": 3') in proc.stdout


@pytest.mark.parametrize("fmt, model", [("mimo", "mimo"), ("glm4_moe", "glm")])
def test_round_trip_bit_exact(batch, fmt, model):
    root, results = batch
    ok(results[f"{fmt}/round_trip"])
    source, written = load_dir(root / model / "hf"), load_dir(root / "out" / f"{fmt}_round_trip")
    assert set(written) == set(source)
    for name, t in source.items():
        assert written[name].dtype == t.dtype and torch.equal(written[name], t), name


def test_glm_two_mtp_layers(batch):
    """Two NextN layers: vLLM export verified for K=2 (absolute indices N, N+1; step 2 gets
    step 1's output after shared_head.norm, as current vLLM computes); K=3 cannot be verified
    (Megatron runs two layers as two steps); SGLang refused."""
    root, results = batch
    log = ok(results["glm_2mtp/vllm"]).stdout
    assert "max_diff_mtp2" in log and "2 draft step(s) through 2 MTP layer(s)" in log, log
    assert "the checkpoint has 2 MTP layers, which the Megatron model runs as exactly 2 steps" in _error_line(
        results["glm_2mtp/vllm_k3"])
    names = set(load_dir(root / "out" / "glm_2mtp_vllm"))
    assert names == GLM_LAYER2 | {n.replace("layers.2.", "layers.3.") for n in GLM_LAYER2}
    assert "SGLang loads one NextN layer; the checkpoint has 2" in _error_line(results["glm_2mtp/sglang"])


def test_reference_forward_sees_swapped_halves(batch):
    """The independent MiMo forward depends on the concat order: a Megatron-order projection
    (embedding half first) written unswapped would fail the verification."""
    import json

    from bebop_megatron.convert.verify import mimo_draft_logits

    mimo = batch[0] / "mimo"
    config = json.loads((mimo / "hf" / "config.json").read_text())
    weights = load_dir(mimo / "hf")
    tokens = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(2))
    good = mimo_draft_logits(weights, config, hidden, tokens, 1)[0]
    w = weights["model.mtp_layers.0.input_proj.weight"]
    weights["model.mtp_layers.0.input_proj.weight"] = torch.cat(torch.chunk(w, 2, dim=1)[::-1], dim=1)
    bad = mimo_draft_logits(weights, config, hidden, tokens, 1)[0]
    assert (good - bad).abs().max() > 1e-2


# Re-saved on 4 ranks; GLM's dense layer 0 and MoE layer 1 land on different stages. (MiMo's
# layout change is covered by the export of its TP=2 training checkpoint below.)
GLM_RESHARD = ["parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2",
               "parallel.expert_tensor=1"]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """Every conversion, export, re-save, training run and decode of this module in one 4-rank
    launch (tests/helpers/cli_batch.py), so that torch and Megatron-Core are imported once per
    rank. In order:

    - rank 0 alone (a single process with a process group of its own) makes the
      :func:`single_process_calls`;
    - ``resaved``: the GLM checkpoint re-saved at PP=2 x TP=2 with SP and EP=2 (the 4 ranks);
    - ``run``: the user's path, training on the imported MiMo backbone at TP=2 (ranks 0 and 1, a
      world of two with a process group of its own);
    - rank 0 alone: the exports and decodes of those checkpoints: the re-saved one, the MTP-only
      training checkpoint with and without ``--backbone``, and ``tools/speculative_generate.py`` on
      it and on its full export.

    Returns ``(root, results, tmp, exports)``: models under ``root / NAME`` (``hf``,
    ``megatron``) with a result per named single-process call; the multi-rank runs' checkpoints
    under ``tmp`` with a result per named export or decode of them."""
    root, tmp = tmp_path_factory.mktemp("export"), tmp_path_factory.mktemp("launched")
    names, single = single_process_calls(root)
    mimo = root / "mimo"
    resaved, save = tmp / "resaved", tmp / "run"
    reshard = {"tool": "tests/helpers/convert_reshard_case.py",
               "argv": ["--ckpt", str(root / "glm" / "megatron"), "--out", str(resaved), *GLM_RESHARD]}
    train = ["--config", str(mimo / "megatron" / "bebop_model.yaml"), "device=cpu", "parallel.tensor=2",
             f"model.init_checkpoint={mimo / 'megatron'}", "train.steps=2", "train.micro_batch_size=2",
             "train.global_batch_size=2", "train.seq_length=16", "train.lr=1e-2", f"save.dir={save}",
             "data.num_samples=16", "mtp.num_steps=2"]  # the one MTP layer repeated for 2 steps
    spec = ["--prompts", str(REPO / "examples" / "data" / "tiny_valid.jsonl"), "--limit", "2", "--gamma", "2",
            "--max-new-tokens", "10", "--seed", "3"]
    calls = {
        "pp2tp2": ("convert_to_hf", ["--checkpoint", str(resaved), "--format", "glm4_moe", "--target", "vllm",
                                     "--out", str(tmp / "pp2tp2"), "--no-verify"]),
        "no_backbone": ("convert_to_hf", ["--checkpoint", str(save), "--format", "mimo", "--target", "vllm",
                                          "--out", str(tmp / "o")]),
        "mtp_only": ("convert_to_hf", ["--checkpoint", str(save), "--backbone", str(mimo / "megatron"), "--format",
                                       "mimo", "--target", "sglang", "--mtp-only", "--out", str(tmp / "o")]),
        "full": ("convert_to_hf", ["--checkpoint", str(save), "--backbone", str(mimo / "megatron"), "--format",
                                   "mimo", "--target", "sglang", "--no-verify", "--out", str(tmp / "full")]),
        "decode_ckpt": ("speculative_generate", ["--checkpoint", str(save), *spec, "--json", str(tmp / "a")]),
        "decode_full": ("speculative_generate", ["--checkpoint", str(tmp / "full"), *spec, "--json", str(tmp / "b")]),
        "decode_mtp_only": ("speculative_generate", ["--checkpoint", str(tmp / "o"), *spec]),
    }
    done = run_batch(
        [{**call, "alone": True} for call in single]
        + [reshard, {"tool": "pretrain_mtp", "ranks": 2, "argv": train}]
        + [{"tool": tool, "alone": True, "argv": (["--no-progress"] if tool == "convert_to_hf" else []) + argv}
           for tool, argv in calls.values()], tmp / "batch", nproc=4)
    results = dict(zip(names, done[:len(single)]))
    for name in names:
        if name.startswith("import/"):
            ok(results[name])
    resharded, trained = done[len(single):len(single) + 2]
    ok(resharded)
    ok(trained)
    return root, results, tmp, dict(zip(calls, done[len(single) + 2:]))


@pytest.fixture(scope="module")
def batch(launch):
    """``(root, results)`` of the :func:`single_process_calls`."""
    return launch[:2]


@pytest.fixture(scope="module")
def launched(launch):
    """``(tmp, results)`` of the exports and decodes of the multi-rank runs' checkpoints."""
    return launch[2:]


def test_export_from_pp2_tp2_equals_tp1(batch, launched):
    (root, results), (tmp, exports) = batch, launched
    ok(exports["pp2tp2"])
    ok(results["glm4_moe/round_trip"])  # the same export from the TP=1 checkpoint
    ref, got = load_dir(root / "out" / "glm4_moe_round_trip"), load_dir(tmp / "pp2tp2")
    assert set(ref) == set(got)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


def test_errors(batch):
    results = batch[1]
    assert "--format deepseek needs a DeepSeek-V3 checkpoint" in _error_line(results["error/deepseek"])
    assert "needs a GLM-4.5 MoE checkpoint" in _error_line(results["error/glm_on_mimo"])
    assert "unknown --format 'eagle'" in _error_line(results["error/format"])
    assert "unknown --target 'trtllm'" in _error_line(results["error/target"])
    assert "not found" in _error_line(results["error/missing"])
    assert "SGLang's MiMoMTP loads one MTP layer; the checkpoint has 2" in _error_line(results["mimo_2mtp/sglang"])
    # Qwen3 is Qwen2-shaped but for its qk-norms, which MiMo's layers do not have
    assert "--format mimo needs a Qwen2-shaped dense model" in _error_line(results["qwen3/mimo"])


def test_export_from_training_checkpoint(batch, launched):
    """The user's path: train on the imported backbone at TP=2 (2 ranks), export the MTP-only
    training checkpoint with ``--backbone``; verified, and the MTP weights did change."""
    mimo, (tmp, results) = batch[0] / "mimo", launched
    save = tmp / "run"
    line = _error_line(results["no_backbone"])
    assert "holds only MTP weights" in line
    proc = ok(results["mtp_only"])
    assert "max_diff_mtp1" in proc.stdout
    trained, source = load_dir(tmp / "o"), load_dir(mimo / "hf")
    assert not torch.equal(trained["model.mtp_layers.0.input_proj.weight"],
                           source["model.mtp_layers.0.input_proj.weight"])
    assert torch.equal(trained["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    # K = the trained mtp.num_steps (2), one reused layer; trained with the default post_norm
    # chain, as MiMo's engines run it: no warning.
    assert "max_diff_mtp2" in proc.stdout and "max_diff_mtp3" not in proc.stdout, proc.stdout
    assert "warning:" not in proc.stdout
    from bebop_megatron.convert.exporter import _training_common
    from bebop_megatron.convert.handoff import trained_chain

    ckpt = str(save / (save / "latest").read_text())
    trained = trained_chain(ckpt, _training_common(ckpt))
    assert (trained.num_steps, trained.handoff, trained.source) == (2, "post_norm", "the training config")

    # tools/speculative_generate.py on the full export (imported in memory) decodes exactly as on
    # the training checkpoint: same texts, same accepted counts; the --mtp-only export is refused.
    for name in ("full", "decode_ckpt", "decode_full"):
        ok(results[name])
    from_ckpt, from_export = (json.loads((tmp / name).read_text()) for name in ("a", "b"))
    assert from_export["texts"] == from_ckpt["texts"] and from_ckpt["new_tokens"] > 0
    assert from_export["per_position"] == from_ckpt["per_position"]
    assert from_export["measured_accept_len"] == from_ckpt["measured_accept_len"]
    assert from_export["predicted_accept_len"] == pytest.approx(from_ckpt["predicted_accept_len"], abs=1e-5)
    line = _error_line(results["decode_mtp_only"])
    assert "holds no backbone layers" in line and "--mtp-only" in line


def test_qwen2_copy_last_layer_as_mimo(batch):
    """A model without MTP layers, warm-started with --mtp-init copy_last_layer and exported as
    MiMo: the MTP decoder layer is the last backbone layer, its final norm the model's."""
    root, results = batch
    ok(results["qwen2_copy/sglang"])
    w = load_dir(root / "out" / "qwen2_copy_sglang")
    for n in QWEN2_LAYER:
        assert torch.equal(w[f"model.mtp_layers.0.{n}"], w[f"model.layers.1.{n}"]), n
    assert torch.equal(w["model.mtp_layers.0.final_layernorm.weight"], w["model.norm.weight"])
    # tied embeddings: lm_head is written anyway, for vLLM's strict MiMoMTP loader
    assert torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])


def test_mimo_two_mtp_layers_refused_for_vllm(batch):
    """vLLM's MiMoMTP drafts with its first MTP layer only: a second layer is refused."""
    line = _error_line(batch[1]["mimo_2mtp/vllm"])
    assert "vLLM's MiMoMTP predicts with its first MTP layer only; the checkpoint has 2" in line



def test_mimo_mtp_only_refused_for_vllm(batch):
    """vLLM builds the MiMo draft from the served model's config (mimo_mtp.py reads its
    num_nextn_predict_layers): a draft-only export beside a plain target fails in vLLM
    ('Qwen2Config' object has no attribute 'num_nextn_predict_layers'), so it is refused."""
    line = _error_line(batch[1]["mimo/vllm/True"])
    assert "--mtp-only: vLLM's MiMo draft reads num_nextn_predict_layers from the served model's config" in line
    assert "export the full model" in line


def test_handoff_default_and_legacy(batch):
    """vLLM's default hand-off is post-norm for every format; ``--vllm-handoff pre_norm`` (vLLM
    releases before PR #45895) is GLM/DeepSeek-only and is verified against heads trained that
    way; a mismatch of training and target fails --verify at step 2 while step 1 matches."""
    results = batch[1]
    assert ("vLLM's mimo draft hands the next step the post-norm state in every release"
            in _error_line(results["handoff/mimo_legacy"]))
    assert "--vllm-handoff applies to --target vllm only" in _error_line(results["handoff/glm_sglang_legacy"])
    # heads recorded as trained pre_norm: verified for legacy vLLM, K=3 through the reused layer
    log = ok(results["handoff/glm_pre_legacy"]).stdout
    assert "max_diff_mtp3" in log and "each handing the next the pre-norm state as vllm does" in log, log
    assert "warning:" not in log and "serve with (one of vLLM releases before PR #45895" in log, log
    # ... and fail at step 2 for current vLLM and for SGLang (post-norm)
    failed_at_step_2(results["handoff/glm_pre_vllm"], "post-norm", "pre_norm")
    failed_at_step_2(results["handoff/glm_pre_sglang"], "post-norm", "pre_norm")
    # heads trained post_norm exported for legacy vLLM: fail at step 2; K=1 never hands anything on
    failed_at_step_2(results["handoff/glm_legacy_on_post"], "pre-norm", "post_norm")
    log = ok(results["handoff/glm_legacy_on_post_k1"]).stdout
    assert "max_diff_mtp1" in log and "max_diff_mtp2" not in log and "warning:" not in log, log
