"""A directory of the wrong kind given as a checkpoint: one line saying what it is and what to pass
(issue 26 items 14 and 21), before any model is built.

- ``model.backbone_checkpoint`` (or ``model.init_checkpoint``) = a training checkpoint or a
  training run's ``save.dir`` (MTP heads, no backbone weights: it failed with a ``KeyError``);
- ``model.backbone_checkpoint`` = an import of ``tools/convert_from_hf.py`` with other sizes than
  its ``bebop_model.yaml`` (a 50-line ``CheckpointingException``); with them it loads;
- ``tools/eval_acceptance.py --checkpoint`` = such an import (it said "is damaged"), and
  ``tools/speculative_generate.py --checkpoint`` alike (it still did: issue 36), one shared line.

The import is real (a tiny Llama, in process); the training checkpoints here are their marker
files (tests/test_production_resume.py checks a real one).
"""

from __future__ import annotations

import importlib.util

import pytest

from bebop_megatron.config import ConfigError, load_config
from tests.helpers.convert_models import make_hf_model
from tests.helpers.launch import REPO


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from bebop_megatron.convert.importer import convert_from_hf

    from tests.helpers.single_process import tear_down

    root = tmp_path_factory.mktemp("kinds")
    hf_dir = make_hf_model("llama", root / "hf")
    try:
        convert_from_hf(str(hf_dir), str(root / "llama"), max_tensor_parallel=1, progress=False,
                        log=lambda line: None)
    finally:  # the import builds the model in a process group of one: leave none to the other tests
        tear_down()
    return root / "llama"


def refusal(*overrides, path=None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_an_import_needs_the_sizes_it_records(imported):
    record = imported / "bebop_model.yaml"
    message = refusal(f"model.backbone_checkpoint={imported}")
    assert message.startswith(f"model.backbone_checkpoint={imported} is a model imported by tools/convert_from_hf.py "
                              "with other sizes than this run's: model.num_layers=2 (this run: 4), "
                              "model.hidden_size=64 (this run: 128), "), message
    assert message.endswith(f"; use the settings of {record} (copy its model/mtp sections into the run's config)")
    cfg = load_config(str(record), [f"model.backbone_checkpoint={imported}"])  # its sections as the config: loads
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (2, 64)
    # the MTP layers count too when they are loaded (model.init_checkpoint)
    assert "mtp.num_layers=1 (this run: 3)" in refusal(f"model.init_checkpoint={imported}", "mtp.num_layers=3",
                                                       path=str(record))


def test_a_training_checkpoint_or_save_dir_is_no_backbone(tmp_path):
    run = tmp_path / "run"
    ckpt = run / "iter_0000002"
    ckpt.mkdir(parents=True)
    for name in ("metadata.json", ".metadata", "common.pt"):
        (ckpt / name).write_text("x")
    (ckpt / "config.yaml").write_text("model:\n  backbone_checkpoint: /models/base\n")
    (run / "latest").write_text("iter_0000002")
    advice = ("; pass the backbone the run was trained on (a model checkpoint, e.g. from tools/convert_from_hf.py), "
              "or resume the run with its save.dir and train.resume=auto")
    assert refusal(f"model.backbone_checkpoint={ckpt}") == (
        f"model.backbone_checkpoint={ckpt} is a training checkpoint: it holds MTP heads and optimizer state, not the "
        f"backbone's weights (it was trained on /models/base){advice}")
    assert refusal(f"model.init_checkpoint={run}") == (
        f"model.init_checkpoint={run} is a training run's save.dir: it holds MTP heads and optimizer state, not the "
        f"backbone's weights{advice}")


@pytest.mark.parametrize("name, argv", [("eval_acceptance", ["--data", "synthetic"]),
                                        ("speculative_generate", ["--prompts", "p.jsonl"])])
def test_the_evaluation_tools_say_an_import_is_no_training_checkpoint(imported, tmp_path, name, argv):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(ValueError) as err:
        tool.main(["--checkpoint", str(imported), *argv, *(["--out-dir", str(tmp_path / "r")] if name ==
                                                           "eval_acceptance" else [])])
    assert str(err.value) == (
        f"--checkpoint {imported} is a model imported by tools/convert_from_hf.py, not a training checkpoint: train "
        f"MTP heads on it (model.backbone_checkpoint={imported}, or model.init_checkpoint to start from its MTP "
        "layers, with the settings of its bebop_model.yaml) and pass that run's save.dir")
