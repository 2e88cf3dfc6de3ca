"""Qwen3-Next and Qwen3.5 (dense, MoE, multimodal layout): export, round trips, K-step drafts, refusals.

Tiny random models (tests/helpers/qwen_models.py: one Gated DeltaNet and one gated-attention
layer, hidden 64, fp32, one MTP layer with the published ``mtp.*`` names) are imported with
``tools/convert_from_hf.py`` and exported with ``tools/convert_to_hf.py``, all in one process
(tests/helpers/cli_batch.py). Checked:
- the exact key sets below, written from vLLM's and SGLang's ``qwen3_next_mtp.py`` /
  ``qwen3_5_mtp.py`` loaders (``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
  ``mtp.layers.0.*`` with the family's names, one tensor per expert, ``mtp.norm``; the
  embedding and ``lm_head`` that vLLM's strict draft loader wants), with ``--verify`` on: the
  written backbone in transformers and an independent draft forward match the Megatron model;
- the MTP config field (Qwen3.5: ``text_config.mtp_num_hidden_layers``; Qwen3-Next:
  ``num_nextn_predict_layers``) and the serve commands with rejection sampling;
- HF -> Megatron -> HF bit-exact (fp32 and bf16; the Gated DeltaNet norm goes through ``w - 1``);
- three draft steps of one reused layer: the Megatron chain equals the reference that hands
  on the ``mtp.norm`` output (both engines), and differs from one that hands on the output
  before it (so the check sees the hand-off);
- refusals, one ``error:`` line each (and the config's for packed rows under SP).
The K-step drafts (tests/helpers/qwen_kstep_case.py) run in the same process, after the exports.
Import logits against transformers (TP=1, TP=2+SP, EP=2): tests/test_convert_import.py; MTP
training at PP=2 / EP=2 against one rank: tests/distributed/test_layouts.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.cli_batch import run_batch
from tests.helpers.qwen_models import make_qwen_model

ATTN = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
        "self_attn.k_norm.weight"]
GDN_35 = ["input_layernorm.weight", "post_attention_layernorm.weight"] + [
    f"linear_attn.{n}" for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                                 "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")]
GDN_NEXT = ["input_layernorm.weight", "post_attention_layernorm.weight"] + [
    f"linear_attn.{n}" for n in ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias",
                                 "norm.weight", "out_proj.weight")]
DENSE = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
MOE = (["mlp.gate.weight", "mlp.shared_expert_gate.weight"]
       + [f"mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")]
       + [f"mlp.experts.{j}.{n}_proj.weight" for j in range(4) for n in ("gate", "up", "down")])
MTP_OWN = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"}


def keys(prefix: str, gdn: list[str], mlp: list[str]) -> dict[str, set]:
    """(full, mtp-only) key sets: backbone under ``prefix``, MTP top level."""
    mtp = MTP_OWN | {f"mtp.layers.0.{n}" for n in ATTN + mlp}
    shared = {f"{prefix}embed_tokens.weight", "lm_head.weight"}
    backbone = ({f"{prefix}norm.weight"} | {f"{prefix}layers.0.{n}" for n in gdn + mlp}
                | {f"{prefix}layers.1.{n}" for n in ATTN + mlp})
    return {"full": shared | backbone | mtp, "mtp_only": shared | mtp}


EXPECTED = {
    "qwen3_5": keys("model.", GDN_35, DENSE),
    "qwen3_5_mm": keys("model.language_model.", GDN_35, DENSE),
    "qwen3_5_moe": keys("model.", GDN_35, MOE),
    "qwen3_next": keys("model.", GDN_NEXT, MOE),
}
FORMAT = {"qwen3_5": "qwen3_5", "qwen3_5_mm": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_next": "qwen3_next"}
# (model, target, mtp_only): every family full for vLLM; the draft alone and SGLang on two of them
EXPORTS = [(m, "vllm", False) for m in EXPECTED] + [
    ("qwen3_5_mm", "vllm", True), ("qwen3_next", "vllm", True), ("qwen3_next", "sglang", True)]


def _name(model, target, mtp_only):
    return f"{model}_{target}_{'mtp' if mtp_only else 'full'}"


def _error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    conf = json.loads((dst / "config.json").read_text())
    conf.update(changes)
    (dst / "config.json").write_text(json.dumps(conf))
    return dst


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """Imports, exports, refused calls and the K-step drafts in one process: ``(root, name -> result)``."""
    root = tmp_path_factory.mktemp("qwen")
    calls, names = [], []

    def add(name, tool, argv):
        names.append(name)
        calls.append({"tool": tool, "argv": ["--no-progress", *argv]})

    models = {m: make_qwen_model(m, root / m / "hf") for m in EXPECTED}
    models["qwen3_5_bf16"] = make_qwen_model("qwen3_5", root / "qwen3_5_bf16" / "hf", dtype=torch.bfloat16)
    models["qwen3_5_no_mtp"] = make_qwen_model("qwen3_5", root / "qwen3_5_no_mtp" / "hf", with_mtp=False, tie=True)
    for m, hf_dir in models.items():
        add(f"import/{m}", "convert_from_hf", ["--hf-dir", str(hf_dir), "--out", str(root / m / "megatron"),
                                               "--max-tensor-parallel", "2"])
    for model, target, mtp_only in EXPORTS:
        add(_name(model, target, mtp_only), "convert_to_hf", [
            "--checkpoint", str(root / model / "megatron"), "--format", FORMAT[model], "--target", target,
            "--out", str(root / "out" / _name(model, target, mtp_only)), *(["--mtp-only"] if mtp_only else [])])
    for model in ("qwen3_5_bf16", "qwen3_5_no_mtp"):
        add(f"export/{model}", "convert_to_hf", ["--checkpoint", str(root / model / "megatron"), "--format",
                                                 "qwen3_5", "--target", "vllm", "--out", str(root / "out" / model)])
    # refusals
    bad = {"sparse_step": dict(decoder_sparse_step=2), "attention_bias": dict(attention_bias=True)}
    for name, change in bad.items():
        hf_dir = _edit_config(models["qwen3_next"], root / f"bad_{name}", **change)
        add(f"error/{name}", "convert_from_hf", ["--hf-dir", str(hf_dir), "--out", str(root / "out" / name)])
    two = root / "bad_two_mtp"
    shutil.copytree(models["qwen3_5"], two)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(two / "model.safetensors"))
    weights.update({k.replace("mtp.layers.0.", "mtp.layers.1."): v.clone() for k, v in weights.items()
                    if k.startswith("mtp.layers.0.")})
    save_file(weights, str(two / "model.safetensors"))
    add("error/two_mtp", "convert_from_hf", ["--hf-dir", str(two), "--out", str(root / "out" / "two_mtp")])
    base = ["--checkpoint", str(root / "qwen3_5" / "megatron"), "--target", "vllm", "--out", str(root / "out" / "e")]
    add("error/next_on_35", "convert_to_hf", [*base, "--format", "qwen3_next"])
    add("error/mimo_on_35", "convert_to_hf", [*base, "--format", "mimo"])
    no_vision = models["qwen3_5_mm"]  # the source directory: config and tokenizer, no hf/vision.safetensors
    add("error/no_vision", "convert_to_hf", ["--checkpoint", str(root / "qwen3_5_mm" / "megatron"), "--format",
                                             "qwen3_5", "--target", "vllm", "--hf-dir", str(no_vision), "--out",
                                             str(root / "out" / "no_vision")])
    # the K-step drafts of test_three_draft_steps_hand_on_the_normed_state (tests/helpers/qwen_kstep_case.py)
    kstep = [{"ckpt": str(root / m / "megatron"), "export": str(root / "out" / _name(m, "vllm", False))}
             for m in ("qwen3_next", "qwen3_5_mm")]
    (root / "kstep.json").write_text(json.dumps(kstep))
    names.append("kstep")
    calls.append({"tool": "tests/helpers/qwen_kstep_case.py",
                  "argv": ["--spec", str(root / "kstep.json"), "--out", str(root / "kstep_out.json")]})
    results = dict(zip(names, run_batch(calls, root / "batch")))
    for name in names:
        if name.startswith("import/"):
            assert results[name].returncode == 0, (name, results[name].stderr[-3000:])
    return root, results


def _load(path):
    from bebop_megatron.convert.hf_io import read_all

    return read_all(str(path))


@pytest.mark.parametrize("model, target, mtp_only", EXPORTS)
def test_export_key_set_config_and_verify(batch, model, target, mtp_only):
    root, results = batch
    proc = results[_name(model, target, mtp_only)]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verified:" in proc.stdout and "max_diff_mtp1" in proc.stdout, proc.stdout
    # main's K-step verify: the imported mtp.num_steps (3) through the one reused layer, post-norm hand-off
    assert "3 draft step(s) through 1 MTP layer(s), each handing the next the post-norm state" in proc.stdout
    assert "max_diff_mtp3" in proc.stdout and "warning" not in proc.stdout, proc.stdout
    assert ("max_diff_backbone" in proc.stdout) == (not mtp_only)
    out = root / "out" / _name(model, target, mtp_only)
    written = _load(out)
    expected = set(EXPECTED[model]["mtp_only" if mtp_only else "full"])
    if model == "qwen3_5_mm" and not mtp_only:  # the vision tower, written back unchanged
        vision = _load(root / model / "hf")
        expected |= {k for k in vision if k.startswith("model.visual.")}
    assert set(written) == expected
    H = 64
    assert tuple(written["mtp.fc.weight"].shape) == (H, 2 * H)
    assert tuple(written["mtp.layers.0.self_attn.q_proj.weight"].shape) == (2 * 4 * 16, H)  # queries and gates
    conf = json.loads((out / "config.json").read_text())
    if model == "qwen3_next":
        assert conf["num_nextn_predict_layers"] == 1 and conf["architectures"] == ["Qwen3NextForCausalLM"]
    elif model == "qwen3_5_mm":
        assert conf["text_config"]["mtp_num_hidden_layers"] == 1
        assert conf["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    else:
        assert conf["mtp_num_hidden_layers"] == 1
    assert ("--speculative-use-rejection-sampling" if target == "sglang" else '"draft_sample_method": "probabilistic"') \
        in proc.stdout
    assert ("--speculative-num-steps 3" if target == "sglang" else '"num_speculative_tokens": 3') in proc.stdout


@pytest.mark.parametrize("model", list(EXPECTED))
def test_round_trip_bit_exact(batch, model):
    """HF -> Megatron -> HF: every tensor of the source (mtp.* and, multimodal, the vision tower included)."""
    root, _ = batch
    source, written = _load(root / model / "hf"), _load(root / "out" / _name(model, "vllm", False))
    assert set(written) == set(source)
    for name, t in source.items():
        assert written[name].dtype == t.dtype and torch.equal(written[name], t), name


def test_round_trip_bf16_and_tied_model_without_mtp(batch):
    """bf16 weights round-trip bit-exactly (the gated norm through w - 1 in float32); a tied
    checkpoint without mtp.* gets a fresh MTP layer, exported (no lm_head: vLLM's Qwen3.5 draft
    takes the embedding) and verified like an imported one."""
    root, results = batch
    assert results["export/qwen3_5_bf16"].returncode == 0, results["export/qwen3_5_bf16"].stderr[-2000:]
    source, written = _load(root / "qwen3_5_bf16" / "hf"), _load(root / "out" / "qwen3_5_bf16")
    assert set(written) == set(source)
    assert all(written[k].dtype == torch.bfloat16 and torch.equal(written[k], t) for k, t in source.items())
    proc = results["export/qwen3_5_no_mtp"]
    assert proc.returncode == 0 and "verified:" in proc.stdout, proc.stderr[-2000:]
    assert "(random)" in results["import/qwen3_5_no_mtp"].stdout
    written = _load(root / "out" / "qwen3_5_no_mtp")
    assert set(written) == EXPECTED["qwen3_5"]["full"] - {"lm_head.weight"}
    source = _load(root / "qwen3_5_no_mtp" / "hf")
    assert set(source) == {k for k in written if not k.startswith("mtp.")}
    assert all(torch.equal(written[k], t) for k, t in source.items())


def test_three_draft_steps_hand_on_the_normed_state(batch):
    """One MTP layer reused for K=3 steps: Megatron's chain equals the reference with the engines'
    post-norm hand-off at every step, and differs from a pre-norm hand-off from step 2 on."""
    root, results = batch  # the batch's last call (tests/helpers/qwen_kstep_case.py)
    assert results["kstep"].returncode == 0, results["kstep"].stderr[-3000:]
    result = json.loads((root / "kstep_out.json").read_text())
    assert len(result["post"]) == len(result["pre"]) == 2  # qwen3_next, qwen3_5_mm
    for post, pre in zip(result["post"], result["pre"]):
        assert len(post) == 3 and max(post) < 1e-4, post
        assert pre[0] < 1e-4 and min(pre[1:]) > 1e-3, pre  # step 1 needs no hand-off


@pytest.mark.parametrize("name, text", [
    ("sparse_step", "Qwen3-Next with dense layers (mlp_only_layers / decoder_sparse_step) is not supported"),
    ("attention_bias", "qwen3_next with attention_bias=true is not supported"),
    ("two_mtp", "the checkpoint has 2 MTP layers sharing one mtp.fc / mtp.norm"),
    ("next_on_35", "--format qwen3_next needs a Qwen3-Next checkpoint; this checkpoint is qwen3_5"),
    ("mimo_on_35", "--format mimo needs a Qwen2-shaped dense model"),
    ("no_vision", "a full Qwen3_5ForConditionalGeneration export needs the vision tower"),
])
def test_refusals(batch, name, text):
    _, results = batch
    assert text in _error_line(results[f"error/{name}"])


def test_config_refusals_and_gdn_platform(tmp_path):
    """Packed real data with sequence parallelism and Gated DeltaNet layers (each packed document
    runs alone through them, tests/test_trainer_data.py): one error naming the fields. The torch
    l2norm redirection equals a float64 reference, and every redirected attribute exists."""
    from bebop_megatron.config import ConfigError, load_config
    from bebop_megatron.platform import gdn_torch

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a b c"}\n')
    hybrid = ["device=cpu", "model.num_layers=2", "model.layer_types=[linear_attention,full_attention]",
              "model.linear_num_key_heads=2", "model.linear_num_value_heads=4", f"data.train_files=[{data}]",
              "parallel.tensor=2", "parallel.sequence_parallel=true"]
    with pytest.raises(ConfigError, match=r"^data.pack=true with Gated DeltaNet layers .* needs "
                                          r"parallel.sequence_parallel=false"):
        load_config(overrides=hybrid)
    assert load_config(overrides=hybrid + ["data.pack=false"]).model.layer_types[0] == "linear_attention"
    with pytest.raises(ConfigError, match="model.layer_types has 1 entries"):
        load_config(overrides=["device=cpu", "model.num_layers=2", "model.layer_types=[full_attention]"])
    assert gdn_torch.check_megatron_compatibility() == []
    x = torch.randn(3, 5, 7, dtype=torch.float64)
    ref = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(gdn_torch.l2norm(x.float()).double(), ref, rtol=1e-6, atol=1e-7)
