"""The converters never replace what is at ``--out`` without ``--overwrite`` (issue 26, items 1-2).

- ``tools/convert_from_hf.py`` onto an earlier import or a training run's ``iter_N`` (any
  directory with ``metadata.json``): one ``error:`` line naming ``--overwrite``, exit 2, nothing
  touched; with ``--overwrite`` the import is redone. A non-empty directory that is not a
  checkpoint is refused even with ``--overwrite`` (the save deletes the directory first).
- ``tools/convert_to_hf.py`` into a non-empty directory (a user's ``config.json``): refused, the
  file kept; with ``--overwrite`` the export is written.
- ``tools/convert_to_hf.py --out`` that is, contains or lies inside an input directory (the
  import's own ``hf/``, the checkpoint's parent), even with ``--overwrite``: refused before
  anything is written (issue 36, item 4).
- ``tools/convert_to_hf.py --hf-dir`` of another model (another vocabulary and head layout): one
  line naming the fields, nothing written (it used to cut the embedding to that vocabulary and
  print "verified"; issue 36, item 3).

All calls run in one process (tests/helpers/cli_batch.py), each as the tool's command line.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.cli_batch import run_batch
from tests.helpers.convert_models import make_hf_model

USER_CONFIG = '{"mine": true}\n'


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("overwrite")
    hf_dir = make_hf_model("mimo", root / "hf")
    ckpt, iter_dir = root / "megatron", root / "run" / "iter_0000002"
    iter_dir.mkdir(parents=True)
    (iter_dir / "metadata.json").write_text('{"sharded_backend": "torch_dist"}\n')
    (iter_dir / "common.pt").write_bytes(b"trained state")
    (root / "notes").mkdir()
    (root / "notes" / "notes.txt").write_text("keep me\n")
    (root / "export").mkdir()
    (root / "export" / "config.json").write_text(USER_CONFIG)
    other = root / "other_hf"  # another model: the same family, other vocabulary and KV heads
    shutil.copytree(hf_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(vocab_size=80, num_key_value_heads=4)
    (other / "config.json").write_text(json.dumps(config))
    imp = ["--no-progress", "--hf-dir", str(hf_dir), "--max-tensor-parallel", "2", "--out"]
    exp = ["--no-progress", "--checkpoint", str(ckpt), "--format", "mimo", "--target", "vllm", "--no-verify",
           "--out", str(root / "export")]
    calls = {
        "import": ("convert_from_hf", [*imp, str(ckpt)]),
        "import_again": ("convert_from_hf", [*imp, str(ckpt)]),
        "import_onto_iter": ("convert_from_hf", [*imp, str(iter_dir)]),
        "import_onto_notes": ("convert_from_hf", [*imp, str(root / "notes"), "--overwrite"]),
        "import_overwrite": ("convert_from_hf", [*imp, str(ckpt), "--overwrite"]),
        "export_nonempty": ("convert_to_hf", exp),
        "export_overwrite": ("convert_to_hf", [*exp, "--overwrite"]),
        "export_into_hf": ("convert_to_hf", [*exp[:-1], str(ckpt / "hf"), "--overwrite"]),
        "export_over_inputs": ("convert_to_hf", [*exp[:-1], str(root), "--overwrite"]),
        "export_other_hf": ("convert_to_hf", [*exp[:-1], str(root / "other_out"), "--hf-dir", str(other)]),
    }
    procs = run_batch([{"tool": tool, "argv": argv} for tool, argv in calls.values()], root / "batch")
    return root, dict(zip(calls, procs))


def error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def test_import_refuses_an_existing_checkpoint(results):
    root, procs = results
    assert procs["import"].returncode == 0, procs["import"].stderr[-2000:]
    line = error_line(procs["import_again"])
    assert "--overwrite" in line and "earlier import" in line
    line = error_line(procs["import_onto_iter"])
    assert "--overwrite" in line and "iter_0000002" in line
    assert (root / "run" / "iter_0000002" / "common.pt").read_bytes() == b"trained state"
    assert procs["import_overwrite"].returncode == 0, procs["import_overwrite"].stderr[-2000:]
    assert (root / "megatron" / "metadata.json").is_file()


def test_import_never_replaces_other_files(results):
    root, procs = results
    assert "not a Megatron checkpoint" in error_line(procs["import_onto_notes"])
    assert (root / "notes" / "notes.txt").read_text() == "keep me\n"


def test_export_refuses_a_nonempty_out(results):
    root, procs = results
    line = error_line(procs["export_nonempty"])
    assert "--overwrite" in line and "config.json" in line
    proc = procs["export_overwrite"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (root / "export" / "config.json").read_text() != USER_CONFIG
    assert list((root / "export").glob("*.safetensors"))


def test_export_refuses_an_out_among_its_inputs(results):
    root, procs = results
    ckpt = root / "megatron"
    config = (ckpt / "hf" / "config.json").read_text()
    files = sorted(p.name for p in (ckpt / "hf").iterdir())
    assert error_line(procs["export_into_hf"]) == (
        f"error: --out {ckpt / 'hf'} lies inside the input --checkpoint {ckpt}; write the export to a directory "
        "apart from its inputs")
    assert error_line(procs["export_over_inputs"]) == (
        f"error: --out {root} contains the input --checkpoint {ckpt}; write the export to a directory apart from "
        "its inputs")
    assert (ckpt / "hf" / "config.json").read_text() == config  # nothing written there
    assert sorted(p.name for p in (ckpt / "hf").iterdir()) == files


def test_export_refuses_the_config_of_another_model(results):
    root, procs = results
    line = error_line(procs["export_other_hf"])
    assert line.startswith(f"error: --hf-dir {root / 'other_hf'}/config.json does not describe the checkpoint's "
                           "model: vocab_size 80 (checkpoint: 96); num_query_groups 4 (checkpoint: 2); "), line
    assert str(root / "megatron" / "bebop_model.yaml") in line
    assert not (root / "other_out").exists()
