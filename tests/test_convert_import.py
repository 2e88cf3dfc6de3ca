"""HF -> Megatron import: the converted checkpoint's logits equal transformers' (float32).

For each family a tiny random model is built with transformers' config classes and saved
locally; ``tools/convert_from_hf.py`` converts it; the checkpoint is loaded at TP=1 and at a
2-rank layout (TP=2 for dense families; EP=2 and TP=2 with SP for Qwen3-MoE, GLM-4.5, Qwen3.5-MoE and
Qwen3-Next; TP=2 with SP for Qwen3.5) and its
backbone logits compared with the transformers model's (relative 1e-4). Errors: unknown
architecture, missing files, shape mismatch, a truncated safetensors file: exit status 2 and
one ``error:`` line.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.cli_batch import run_batch
from tests.helpers.convert_models import make_hf_model

# family -> layouts checked on 2 ranks, in one process (TP=1 there is TP=1 with DP=2)
LAYOUTS = {
    "llama": ["parallel.tensor=1", "parallel.tensor=2"],
    "qwen2": ["parallel.tensor=1", "parallel.tensor=2"],
    "qwen3": ["parallel.tensor=1", "parallel.tensor=2"],
    "mimo": ["parallel.tensor=1", "parallel.tensor=2"],
    "qwen3_moe": ["parallel.tensor=1", "parallel.expert=2", "parallel.tensor=2,parallel.sequence_parallel=true"],
    "glm4_moe": ["parallel.tensor=1", "parallel.expert=2", "parallel.tensor=2,parallel.sequence_parallel=true"],
    # Qwen3.5 / Qwen3-Next hybrids (one Gated DeltaNet and one gated-attention layer; tests/helpers/qwen_models.py)
    "qwen3_5": ["parallel.tensor=1", "parallel.tensor=2,parallel.sequence_parallel=true"],
    "qwen3_5_mm": ["parallel.tensor=1"],  # the multimodal release's names; layouts as qwen3_5
    "qwen3_5_moe": ["parallel.tensor=1", "parallel.expert=2", "parallel.tensor=2,parallel.sequence_parallel=true"],
    "qwen3_next": ["parallel.tensor=1", "parallel.expert=2", "parallel.tensor=2,parallel.sequence_parallel=true"],
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One 2-rank launch (tests/helpers/cli_batch.py): rank 0 alone first converts all families
    and the broken inputs of ``errors``, each as the tool's command line, as a single process,
    then every family's layouts are checked on both ranks (tests/helpers/convert_logits_case.py):
    ``(family -> (model dir, rel_err per layout), broken input name -> result)``."""
    root = tmp_path_factory.mktemp("import")
    calls, cases = [], []
    for family, layouts in LAYOUTS.items():
        hf_dir = make_hf_model(family, root / family / "hf")
        ckpt = root / family / "megatron"
        calls.append({"tool": "convert_from_hf", "alone": True, "argv": [
            "--hf-dir", str(hf_dir), "--out", str(ckpt), "--max-tensor-parallel", "2", "--no-progress"]})
        cases.append({"ckpt": str(ckpt), "hf_dir": str(hf_dir), "family": family, "layouts": layouts})
    broken, out_dir = broken_inputs(root / "import_errors"), root / "import_errors" / "out"
    calls += [{"tool": "convert_from_hf", "alone": True, "argv": ["--hf-dir", str(path), "--out", str(out_dir / name)]}
              for name, path in broken.items()]
    (root / "cases.json").write_text(json.dumps(cases))
    calls.append({"tool": "tests/helpers/convert_logits_case.py",
                  "argv": ["--spec", str(root / "cases.json"), "--out", str(root / "result.json")]})
    results = run_batch(calls, root / "batch", nproc=2)
    for family, proc in zip(LAYOUTS, results):
        assert proc.returncode == 0, (family, proc.stderr[-3000:])
    assert results[-1].returncode == 0, results[-1].stderr[-3000:]
    errors = json.loads((root / "result.json").read_text())["rel_err"]
    return ({family: (root / family, err) for family, err in zip(LAYOUTS, errors)},
            {**dict(zip(broken, results[len(LAYOUTS):-1])), "out_dir": out_dir})


@pytest.fixture(scope="module")
def imported(converted):
    return converted[0]


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_import_logits_match_transformers(imported, family):
    model_dir, errors = imported[family]
    ckpt = model_dir / "megatron"
    assert (ckpt / "hf" / "tokenizer.json").is_file() and (ckpt / "hf" / "config.json").is_file()
    # bebop_model.yaml trains with the tokenizer saved beside the checkpoint: same ids as the source's
    from transformers import AutoTokenizer

    from bebop_megatron.config import load_config
    from bebop_megatron.data import load_tokenizer

    cfg = load_config(str(ckpt / "bebop_model.yaml"), ["device=cpu"])
    assert cfg.data.tokenizer == os.path.abspath(ckpt / "hf")
    text = "Speculative decoding, 42 times."
    source = AutoTokenizer.from_pretrained(str(model_dir / "hf")).encode(text, add_special_tokens=False)
    assert load_tokenizer(cfg).encode(text) == source
    # The real vocabulary (masked beyond) and the rows that load at TP 1 and 2; K=3 steps by default.
    hf_config = json.loads((model_dir / "hf" / "config.json").read_text())
    hf_config = hf_config.get("text_config", hf_config)  # Qwen3.5's multimodal layout
    assert cfg.model.vocab_size == hf_config["vocab_size"]
    assert cfg.model.padded_vocab_size % 256 == 0 and 0 <= cfg.model.padded_vocab_size - cfg.model.vocab_size < 256
    assert cfg.mtp.num_steps == 3 and cfg.mtp.num_layers == 1
    assert len(errors) == len(LAYOUTS[family])
    for layout, err in zip(LAYOUTS[family], errors):
        assert err < 1e-4, (layout, err)


def _error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    # the progress bar (stderr, "%|") may precede the error
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def broken_inputs(root) -> dict:
    """Broken inputs under ``root`` (each converted once, in the ``converted`` fixture's process):
    ``name -> hf dir``."""
    from safetensors.torch import load_file, save_file

    good = make_hf_model("qwen2", root / "good")
    inputs = {"missing_dir": root / "nowhere"}
    d = inputs["unknown_arch"] = _copy(good, root / "unknown_arch")
    conf = json.loads((d / "config.json").read_text())
    conf["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(conf))
    d = inputs["no_weights"] = _copy(good, root / "no_weights")
    (d / "model.safetensors").unlink()
    d = inputs["no_config"] = _copy(good, root / "no_config")
    (d / "config.json").unlink()
    d = inputs["missing_tensor"] = _copy(good, root / "missing_tensor")
    weights = load_file(str(d / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(d / "model.safetensors"))
    d = inputs["shape_mismatch"] = _copy(good, root / "shape_mismatch")
    conf = json.loads((d / "config.json").read_text())
    conf["num_key_value_heads"] = 4  # the stored k/v projections have 2 heads
    (d / "config.json").write_text(json.dumps(conf))
    for name, keep in (("truncated", -100), ("truncated_header", 4)):  # an interrupted download or copy
        d = inputs[name] = _copy(good, root / name)
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[:keep])
    d = inputs["no_tokenizer"] = _copy(good, root / "no_tokenizer")  # not an error: no data.tokenizer then
    for name in os.listdir(d):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template")):
            (d / name).unlink()
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7}))
    return inputs


@pytest.fixture(scope="module")
def errors(converted):
    """``name -> result`` of each broken input's conversion, and ``out_dir``."""
    return converted[1]


def test_error_unknown_architecture(errors):
    assert "unknown architecture 'FalconForCausalLM'" in _error_line(errors["unknown_arch"])


def test_error_missing_files(errors):
    assert "not found" in _error_line(errors["missing_dir"])
    assert "no *.safetensors" in _error_line(errors["no_weights"])
    assert "config.json" in _error_line(errors["no_config"])


def test_error_missing_tensor_and_shape_mismatch(errors):
    assert "model.layers.1.mlp.up_proj.weight is missing" in _error_line(errors["missing_tensor"])
    line = _error_line(errors["shape_mismatch"])
    assert "shapes do not match config.json" in line or "shape mismatch" in line, line


def test_error_truncated_safetensors_names_the_file(errors):
    for name, reason in (("truncated", "incomplete metadata, file not fully covered"),
                         ("truncated_header", "header too small")):
        path = errors["out_dir"].parent / name / "model.safetensors"
        assert _error_line(errors[name]) == (f"error: {path} is not a readable safetensors file (Error while "
                                             f"deserializing header: {reason}): truncated or damaged? download or "
                                             "copy it again")
        assert not (errors["out_dir"] / name).exists()  # refused before anything is written


def test_generation_config_alone_is_not_a_tokenizer(errors):
    """A model saved without tokenizer files: bebop_model.yaml leaves data.tokenizer unset
    (it used to point at a directory holding only generation_config.json, which cannot load)."""
    from bebop_megatron.config import load_config

    proc = errors["no_tokenizer"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokenizer files: none found" in proc.stdout
    ckpt = str(errors["out_dir"] / "no_tokenizer")
    cfg = load_config(os.path.join(ckpt, "bebop_model.yaml"), ["device=cpu"])
    assert cfg.data.tokenizer is None
    assert os.path.isfile(os.path.join(ckpt, "hf", "generation_config.json"))
