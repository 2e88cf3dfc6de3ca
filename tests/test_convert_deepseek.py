"""DeepSeek-V3 (MLA attention, grouped sigmoid MoE router with e_score_correction_bias and
routed_scaling_factor, shared expert, dense first layer, NextN MTP layer): import and export.

Two tiny random DeepSeek-V3 checkpoints built with transformers' ``DeepseekV3Config`` (float32,
one NextN layer stored as the published checkpoints store it): plain RoPE, and YaRN RoPE (with
``mscale`` / ``mscale_all_dim``, so the cos/sin and softmax factors matter). Checked:
- import: the Megatron model's logits equal transformers' (relative 1e-4) at TP=1, EP=2 and
  TP=2 with SP on 2 ranks (the YaRN model at TP=1 and TP=2);
- export ``--format deepseek`` for vLLM and SGLang, full and ``--mtp-only``: exactly the names
  pinned below, the engines' configs, ``--verify`` passes for K=3 draft steps through the one
  reused NextN layer (transformers' DeepSeek-V3 model and decoder layer as the independent
  forward) and for K=2 through two NextN layers (vLLM), the serve command;
- the hand-off: post-norm by default (current vLLM since PR #45895, SGLang); ``--vllm-handoff
  pre_norm`` (vLLM before it) verifies heads recorded as trained pre-norm and fails at step 2
  for heads trained post-norm (and SGLang fails at step 2 for pre-norm heads);
- HF -> Megatron -> HF reproduces every tensor bit-exactly (both models);
- what the key map cannot represent is refused with one line naming it.
The conversions and exports (tests/helpers/cli_batch.py, each as the tool's command line) and
both models' layouts run in one 2-rank launch, to keep this file short.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.cli_batch import run_batch
from tests.helpers.convert_models import make_hf_model
from tests.helpers.handoff_checks import failed_at_step_2

ATTN = ["input_layernorm.weight", "post_attention_layernorm.weight"] + [
    f"self_attn.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                      "kv_a_layernorm", "kv_b_proj", "o_proj")]
DENSE = ATTN + ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
MOE = (ATTN + ["mlp.gate.weight", "mlp.gate.e_score_correction_bias"]
       + [f"mlp.experts.{j}.{n}_proj.weight" for j in range(4) for n in ("gate", "up", "down")]
       + [f"mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")])
NEXTN = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"]
NEXTN_COPIES = ["shared_head.head.weight", "embed_tokens.weight"]
BACKBONE = ({"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
            | {f"model.layers.0.{n}" for n in DENSE}
            | {f"model.layers.{i}.{n}" for i in (1, 2) for n in MOE})
LAYER3 = {f"model.layers.3.{n}" for n in MOE + NEXTN + NEXTN_COPIES}
EXPECTED = {  # vLLM: absolute index N=3 with head/embedding copies; SGLang NextN: model.layers.0, no copies
    ("vllm", False): BACKBONE | LAYER3,
    ("sglang", False): BACKBONE | LAYER3,
    ("vllm", True): LAYER3,
    ("sglang", True): {f"model.layers.0.{n}" for n in MOE + NEXTN},
}
COMBOS = [(t, m) for t in ("vllm", "sglang") for m in (False, True)]
LEGACY = ("--vllm-handoff", "pre_norm")  # vLLM releases before PR #45895
MODELS = {  # name -> (make_hf_model family, layouts checked on 2 ranks)
    "rope": ("deepseek_v3", ["parallel.tensor=1", "parallel.expert=2",
                             "parallel.tensor=2,parallel.sequence_parallel=true"]),
    "yarn": ("deepseek_v3_yarn", ["parallel.tensor=1", "parallel.tensor=2,parallel.sequence_parallel=true"]),
}


def load_dir(path) -> dict[str, torch.Tensor]:
    from bebop_megatron.convert.hf_io import read_all

    return read_all(str(path))


def ok(proc):
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    return proc


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """One 2-rank launch (tests/helpers/cli_batch.py): rank 0 alone first imports and exports
    both models as a single process, then their layouts are checked on both ranks
    (tests/helpers/convert_logits_case.py). Returns ``(root, results by call name, rel_err per
    model)``."""
    root = tmp_path_factory.mktemp("deepseek")
    calls, names, cases = [], [], []

    def add(name, tool, argv):
        names.append(name)
        calls.append({"tool": tool, "alone": True, "argv": ["--no-progress", *argv]})

    for name, (family, layouts) in MODELS.items():
        hf_dir = make_hf_model(family, root / name / "hf")
        ckpt = root / name / "megatron"
        add(f"import/{name}", "convert_from_hf", ["--hf-dir", str(hf_dir), "--out", str(ckpt),
                                                   "--max-tensor-parallel", "2"])
        cases.append({"ckpt": str(ckpt), "hf_dir": str(hf_dir), "family": family, "layouts": layouts})
    for target, mtp_only in COMBOS:
        add(f"rope/{target}/{mtp_only}", "convert_to_hf",
            ["--checkpoint", str(root / "rope" / "megatron"), "--format", "deepseek", "--target", target,
             "--out", str(root / "out" / f"rope_{target}_{mtp_only}"), *(["--mtp-only"] if mtp_only else [])])
    # two NextN layers (vLLM only); the rope model's heads recorded as trained pre-norm
    hf2 = make_hf_model("deepseek_v3", root / "rope2" / "hf", num_mtp=2)
    add("import/rope2", "convert_from_hf", ["--hf-dir", str(hf2), "--out", str(root / "rope2" / "megatron")])
    add("rope2/vllm/True", "convert_to_hf", ["--checkpoint", str(root / "rope2" / "megatron"), "--format", "deepseek",
                                             "--target", "vllm", "--mtp-only", "--out", str(root / "out" / "rope2")])
    names.append("record/rope_pre")
    calls.append({"tool": "record_mtp", "alone": True, "argv": [
        str(root / "rope" / "megatron"), str(root / "rope_pre" / "megatron"), "next_step_input=pre_norm"]})
    for name, model, target, extra in (("handoff/pre_legacy", "rope_pre", "vllm", LEGACY),
                                       ("handoff/pre_sglang", "rope_pre", "sglang", ()),
                                       ("handoff/post_legacy", "rope", "vllm", LEGACY)):
        add(name, "convert_to_hf", ["--checkpoint", str(root / model / "megatron"), "--format", "deepseek", "--target",
                                    target, "--mtp-only", "--out", str(root / "out" / name.replace("/", "_")), *extra])
    add("yarn/vllm/False", "convert_to_hf", ["--checkpoint", str(root / "yarn" / "megatron"), "--format", "deepseek",
                                             "--target", "vllm", "--out", str(root / "out" / "yarn_vllm_False")])
    (root / "cases.json").write_text(json.dumps(cases))
    names.append("logits")
    calls.append({"tool": "tests/helpers/convert_logits_case.py",
                  "argv": ["--spec", str(root / "cases.json"), "--out", str(root / "result.json")]})
    results = dict(zip(names, run_batch(calls, root / "batch", nproc=2)))
    ok(results["logits"])
    for name in [*MODELS, "rope2"]:
        ok(results[f"import/{name}"])
    errors = dict(zip(MODELS, json.loads((root / "result.json").read_text())["rel_err"]))
    return root, results, errors


@pytest.mark.parametrize("name", list(MODELS))
def test_import_logits_match_transformers(deepseek, name):
    root, _, errors = deepseek
    model = (root / name / "megatron" / "bebop_model.yaml").read_text()
    assert "multi_latent_attention: true" in model and f"rope_type: {name}" in model
    layouts = MODELS[name][1]
    assert len(errors[name]) == len(layouts)
    for layout, err in zip(layouts, errors[name]):
        assert err < 1e-4, (layout, err)


@pytest.mark.parametrize("target,mtp_only", COMBOS)
def test_export_key_set_and_verify(deepseek, target, mtp_only):
    root, results, _ = deepseek
    log = ok(results[f"rope/{target}/{mtp_only}"]).stdout
    out = root / "out" / f"rope_{target}_{mtp_only}"
    assert "verified:" in log and "max_diff_mtp3" in log, log  # K=3 through the reused NextN layer
    assert "3 draft step(s) through 1 MTP layer(s), each handing the next the post-norm state" in log, log
    assert ("max_diff_backbone" in log) == (not mtp_only)
    assert set(load_dir(out)) == EXPECTED[target, mtp_only]
    conf = json.loads((out / "config.json").read_text())
    assert conf["num_nextn_predict_layers"] == 1 and conf["model_type"] == "deepseek_v3"
    assert conf["scoring_func"] == "sigmoid" and conf["topk_method"] == "noaux_tc"
    if target == "sglang" and mtp_only:
        assert conf["architectures"] == ["DeepseekV3ForCausalLMNextN"] and conf["num_hidden_layers"] == 1
    else:
        assert conf["architectures"] == ["DeepseekV3ForCausalLM"] and conf["num_hidden_layers"] == 3
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    if target == "sglang":
        assert (f"--speculative-algorithm NEXTN --speculative-draft-model-path {out} " in log
                and "--speculative-use-rejection-sampling" in log), log
    else:
        assert '"method": "mtp"' in log and '"draft_sample_method": "probabilistic"' in log, log


@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_bit_exact(deepseek, name):
    root, results, _ = deepseek
    log = ok(results[f"{name}/vllm/False"]).stdout
    assert "max_diff_backbone" in log and "max_diff_mtp1" in log  # verified, YaRN included
    source, written = load_dir(root / name / "hf"), load_dir(root / "out" / f"{name}_vllm_False")
    assert set(written) == set(source)
    for key, t in source.items():
        assert written[key].dtype == t.dtype and torch.equal(written[key], t), key


def test_two_nextn_layers_and_handoffs(deepseek):
    """K=2 through two NextN layers (absolute indices N, N+1) for vLLM; the legacy vLLM hand-off
    verified against heads trained pre-norm, and a mismatch failing at step 2."""
    root, results, _ = deepseek
    log = ok(results["rope2/vllm/True"]).stdout
    assert "max_diff_mtp2" in log and "2 draft step(s) through 2 MTP layer(s)" in log, log
    assert set(load_dir(root / "out" / "rope2")) == LAYER3 | {n.replace("layers.3.", "layers.4.") for n in LAYER3}
    log = ok(results["handoff/pre_legacy"]).stdout
    assert "max_diff_mtp3" in log and "each handing the next the pre-norm state as vllm does" in log, log
    assert "warning:" not in log
    failed_at_step_2(results["handoff/pre_sglang"], "post-norm", "pre_norm")
    failed_at_step_2(results["handoff/post_legacy"], "pre-norm", "post_norm")


def _describe_error(**changes) -> str:
    from bebop_megatron.convert.errors import ConvertError
    from bebop_megatron.convert.hf_config import describe

    cfg = make_hf_config()
    cfg.update(changes)
    with pytest.raises(ConvertError) as err:
        describe(cfg)
    line = str(err.value)
    assert "\n" not in line
    return line


def make_hf_config() -> dict:
    from tests.helpers.convert_models import hf_config

    cfg = hf_config("deepseek_v3").to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    return cfg


def test_refused_configs():
    from bebop_megatron.convert.hf_config import describe, model_overrides

    assert describe(make_hf_config()).layer.mla
    assert "rope_interleave=false" in _describe_error(rope_interleave=False)
    assert "attention_bias=true" in _describe_error(attention_bias=True)
    assert "quantized checkpoint (quantization_config, fp8)" in _describe_error(
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    assert "scoring_func='softmax'" in _describe_error(scoring_func="softmax")
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}
    assert "mscale_all_dim but no mscale" in _describe_error(rope_parameters={**yarn, "mscale_all_dim": 1.0})
    assert "attention_factor" in _describe_error(rope_parameters={**yarn, "attention_factor": 1.2})
    # YaRN without mscale/mscale_all_dim: transformers scales cos/sin by m(factor, 1), as these fields do
    cfg = make_hf_config()
    cfg["rope_parameters"] = yarn
    out = model_overrides(describe(cfg), 256, 128)
    assert (out["yarn_mscale"], out["yarn_mscale_all_dim"], out["yarn_scaling_factor"]) == (1.0, 0.0, 4.0)


def test_mla_config_validation():
    from bebop_megatron.config import ConfigError, load_config

    mla = ["model.family=moe", "model.num_experts=4", "model.num_query_groups=4", "model.multi_latent_attention=true",
           "model.kv_lora_rank=16", "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16",
           "model.q_lora_rank=32"]
    assert load_config(overrides=mla).model.multi_latent_attention
    cases = {
        ("model.q_lora_rank=32",): "model.q_lora_rank=32 needs model.multi_latent_attention=true",
        (*mla, "model.num_query_groups=2"): "model.num_query_groups=2 must equal model.num_attention_heads=4",
        (*mla, "model.qk_pos_emb_head_dim=7"): "model.qk_pos_emb_head_dim=7 must be even",
        (*mla, "model.v_head_dim=null"): "model.v_head_dim=None must be >= 1",
        (*mla, "model.rope_type=ntk"): "model.rope_type='ntk' must be one of rope, yarn",
        (*mla, "parallel.tensor=4", "parallel.sequence_parallel=true", "model.q_lora_rank=30"):
            "parallel.tensor=4 must divide model.q_lora_rank=30",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(overrides=list(overrides))
        assert message in str(err.value), (overrides, str(err.value))
