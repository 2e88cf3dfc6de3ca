"""Heads are exported and resumed only with the backbone they were trained on (issue #15, item 3).

Two tiny MiMo models of the same shapes (seeds 0 and 1) are imported; MTP heads are trained for
one step on the first (``model.backbone_checkpoint``). The training checkpoint records the
backbone's path and fingerprint (bebop_megatron/training/fingerprint.py). Checked:

- ``tools/convert_to_hf.py --backbone`` with the same backbone exports; with the other model (it
  used to print "verified" and write a mix of both) or a copy elsewhere it is one ``error:``
  line naming both; ``--allow-moved-backbone`` accepts the copy (fingerprint alone) but never
  the other model; a checkpoint written before the record existed gets a warning;
- the fingerprint: equal for a copy and for a second import of the same model, different for
  the other model;
- a resume whose backbone files changed under the same path is refused before anything is built;
  so are ``tools/eval_acceptance.py`` and ``tools/speculative_generate.py`` on that checkpoint (they
  used to measure the heads against the other model: issue 36, item 5), which run with the
  unchanged backbone.
"""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.cli_batch import run_batch
from tests.helpers.convert_models import make_hf_model

TRAIN = ["device=cpu", "parallel.tensor=1", "train.steps=1", "train.micro_batch_size=2", "train.global_batch_size=2",
         "train.seq_length=16", "data.num_samples=8"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("backbone")
    for name, seed in (("a", 0), ("b", 1)):
        make_hf_model("mimo", root / name / "hf", seed=seed)
    a, moved = root / "a" / "megatron", root / "moved" / "a" / "megatron"
    # One process (tests/helpers/cli_batch.py): the imports, the training run, then the exports.
    imports = [{"tool": "convert_from_hf", "argv": ["--no-progress", "--hf-dir", str(root / src / "hf"), "--out",
                                                    str(root / dst / "megatron"), "--max-tensor-parallel", "1"]}
               for src, dst in (("a", "a"), ("b", "b"), ("a", "a_again"))]
    train = {"tool": "pretrain_mtp", "argv": ["--config", str(a / "bebop_model.yaml"), *TRAIN,
                                              f"model.backbone_checkpoint={a}", f"save.dir={root / 'run'}"]}
    # the same files elsewhere (with hf/ next to them)
    copy = {"tool": "copytree", "argv": [str(root / "a"), str(root / "moved" / "a")]}
    calls = {
        "same": [str(a)],
        "other": [str(root / "b" / "megatron")],
        "other_allowed": [str(root / "b" / "megatron"), "--allow-moved-backbone"],
        "moved": [str(moved)],
        "moved_allowed": [str(moved), "--allow-moved-backbone"],
    }
    exports = [{"tool": "convert_to_hf", "argv": ["--no-progress", "--checkpoint", str(root / "run"), "--format",
                                                  "mimo", "--target", "sglang", "--mtp-only", "--out",
                                                  str(root / "out" / name), "--backbone", *argv]}
               for name, argv in calls.items()]
    exports += [{"tool": tool, "argv": argv} for tool, argv in _evaluations(root).values()]
    done = run_batch([*imports, train, copy, *exports], root / "batch")
    prepared, results = done[:-len(exports)], done[-len(exports):]
    calls = {**calls, **{f"{name}_unchanged": None for name in _evaluations(root)}}
    for proc in prepared:
        assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = root / "run" / "iter_0000001"
    assert ckpt.is_dir()
    return root, ckpt, dict(zip(calls, results))


def _evaluations(root) -> dict:
    """The evaluation tools on the training checkpoint (a few tokens, no timing)."""
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    return {
        "eval": ("eval_acceptance", ["--checkpoint", str(root / "run"), "--data", "synthetic", "--no-progress",
                                     "--synthetic-samples", "2", "--sim-positions", "0", "--no-speedup",
                                     "--out-dir", str(root / "report")]),
        "generate": ("speculative_generate", ["--checkpoint", str(root / "run"), "--prompts", str(prompts),
                                              "--gamma", "1", "--max-new-tokens", "2"]),
    }


def _error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def test_the_training_backbone_exports(setup):
    root, _, results = setup
    proc = results["same"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verified:" in proc.stdout and "warning" not in proc.stdout


def test_another_model_of_the_same_shapes_is_refused_naming_both(setup):
    from bebop_megatron.training.fingerprint import fingerprint, short

    root, ckpt, results = setup
    a, b = root / "a" / "megatron", root / "b" / "megatron"
    expected = (f"error: --backbone {b} is not the backbone {ckpt} was trained on ({a}): its weights differ "
                f"(fingerprint {short(fingerprint(str(b)))}, trained on {short(fingerprint(str(a)))}); pass the "
                "run's model.backbone_checkpoint")
    assert _error(results["other"]) == expected
    assert _error(results["other_allowed"]) == expected  # the override is for moved files only
    assert not (root / "out" / "other").exists()


def test_a_moved_backbone_needs_the_override_and_then_its_fingerprint_matches(setup):
    root, ckpt, results = setup
    a, moved = root / "a" / "megatron", root / "moved" / "a" / "megatron"
    assert _error(results["moved"]) == (
        f"error: --backbone {moved} is not the backbone {ckpt} was trained on ({a}); if that backbone was moved or "
        "copied here, pass --allow-moved-backbone (its fingerprint is still checked)")
    proc = results["moved_allowed"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"backbone: {moved} has the fingerprint of {a}, which the heads were trained on" in proc.stdout


def test_the_fingerprint_follows_the_weights_not_the_path(setup):
    from bebop_megatron.training.fingerprint import fingerprint
    from bebop_megatron.training.resume import common_state

    root, ckpt, _ = setup
    a = fingerprint(str(root / "a" / "megatron"))
    assert a.startswith("sha256:") and len(a) == 7 + 64
    assert fingerprint(str(root / "moved" / "a" / "megatron")) == a
    assert fingerprint(str(root / "a_again" / "megatron")) == a  # imported again: the same bytes
    assert fingerprint(str(root / "b" / "megatron")) != a
    record = common_state(str(ckpt))["backbone"]
    assert record == {"path": str(root / "a" / "megatron"), "realpath": str((root / "a" / "megatron").resolve()),
                      "fingerprint": a}


def test_a_checkpoint_without_a_record_warns():
    from bebop_megatron.convert.backbone_check import check_backbone

    lines = []
    common = {"config_yaml": "model:\n  backbone_checkpoint: /runs/bb\n", "step": 5}
    check_backbone(common, "/runs/x/iter_0000005", "/elsewhere/bb", False, lines.append)
    assert lines == ["warning: /runs/x/iter_0000005 records no backbone fingerprint (written before they were "
                     "recorded): cannot check that --backbone /elsewhere/bb is the backbone its MTP heads were "
                     "trained on (model.backbone_checkpoint=/runs/bb)"]


def test_resume_refuses_a_backbone_whose_files_changed(setup, tmp_path):
    from bebop_megatron.config import load_config
    from bebop_megatron.training.resume import StartError, plan_start

    root, _, _ = setup
    backbone = root / "a" / "megatron"
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    cfg = load_config(str(backbone / "bebop_model.yaml"),
                      [*TRAIN, f"model.backbone_checkpoint={backbone}", f"save.dir={run}", "train.steps=2"])
    assert plan_start(cfg).resume_path == str(run / "iter_0000001")  # unchanged: resumes
    (run / "run.lock").unlink()
    shutil.move(str(backbone), str(tmp_path / "a_saved"))
    shutil.copytree(root / "b" / "megatron", backbone)  # other weights under the same path
    try:
        with pytest.raises(StartError, match=rf"^cannot resume from {run / 'iter_0000001'}: the backbone {backbone} "
                                             r"is not the one the checkpoint was trained on \(its files changed: "):
            plan_start(cfg)
    finally:
        shutil.rmtree(backbone)
        shutil.move(str(tmp_path / "a_saved"), str(backbone))


def test_evaluation_tools_refuse_a_backbone_whose_files_changed(setup, tmp_path):
    from bebop_megatron.training.fingerprint import fingerprint, short

    root, ckpt, results = setup
    for name in ("eval", "generate"):  # the backbone they were trained on
        assert results[f"{name}_unchanged"].returncode == 0, results[f"{name}_unchanged"].stderr[-3000:]
    backbone = root / "a" / "megatron"
    trained_on, other = fingerprint(str(backbone)), fingerprint(str(root / "b" / "megatron"))
    shutil.move(str(backbone), str(tmp_path / "a_saved"))
    shutil.copytree(root / "b" / "megatron", backbone)  # re-imported with other weights at the same path
    try:
        procs = run_batch([{"tool": tool, "argv": argv} for tool, argv in _evaluations(root).values()],
                          tmp_path / "batch")
    finally:
        shutil.rmtree(backbone)
        shutil.move(str(tmp_path / "a_saved"), str(backbone))
    expected = (f"error: cannot load {ckpt}: the backbone {backbone} is not the one the checkpoint was trained on "
                f"(its files changed: fingerprint {short(other)}, trained on {short(trained_on)}); restore that "
                "backbone (the heads were trained on it)")
    for proc in procs:
        assert _error(proc) == expected
