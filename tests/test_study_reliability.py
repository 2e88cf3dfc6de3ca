"""``tools/objective_study.py`` at its edges (issue 48): nothing of the user's is deleted, renamed
or reused by mistake, and every mistake or disk failure is one line before any work.

- ``--pack DIR``: a folder that is not an earlier pack (a user's notes), a folder at, inside or
  above ``--work``, a file, a read-only file system, a full disk: refused or stopped in one line,
  the user's files byte for byte as they were, no ``DIR.tmp`` left (exit 74 for the disk);
- a work folder made from another model or other prompts, or imported with other MTP steps:
  refused in one line (``WORK/fingerprint.json``);
- the flags and every run's trainer config (objectives, sizes, ``--set``, precision, device,
  ``--ranks``) are checked before the import, at every ``--ranks``; ``--seeds -1``;
  ``--prompts`` with ``--train-data``;
- ``--report-only`` with ``--out`` or ``--work`` a file, or ``--out`` read-only: one line;
- a full disk during the import or a run's checkpoint: exit 74 and one line (it was a SIGSEGV,
  exit 139: CPython 3.12 collecting a BytesIO's memoryview kept alive by the failed write's frames),
  the partial files removed.

The pack's and the report's failures are injected in this process (the tests run as root: a
read-only folder would not stop them); the disk's during a run in a launched study, by a
wrapper that makes Megatron-Core's checkpoint writer meet ``ENOSPC``.
"""

from __future__ import annotations

import builtins
import errno
import gzip
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from bebop_megatron.cli import run_cli
from bebop_megatron.study.preflight import guarded
from tests.helpers import forkserver
from tests.helpers.launch import REPO
from tests.test_objective_study import _env, _tiny_model

TOOL = REPO / "tools" / "objective_study.py"
SIZES = ["--max-new-tokens", "24", "--gen-batch-size", "8", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--tokens", "768", "--curve-points", "2", "--curve-rows", "64",
         "--eval-chunk-positions", "64", "--loss-chunk-tokens", "512", "--num-boot", "50", "--seeds", "0"]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("objective_study_reliability", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cli(tool, argv, capsys) -> tuple[int, str]:
    """The tool as its command line runs it (:func:`bebop_megatron.cli.run_cli`), in this process:
    (exit status, stderr)."""
    try:
        run_cli(lambda: guarded(tool.main, [str(a) for a in argv]))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err[len("error: "):].strip()


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _fake_work(work: Path) -> Path:
    """A work folder as the stages leave it (a response line per split, one finished run), without
    a model: what --pack reads."""
    for n, split in enumerate(("heldout", "train")):
        line = {"id": n, "sample": 0, "messages": [{"role": "user", "content": f"q{n}"},
                                                   {"role": "assistant", "content": f"a{n}"}],
                "finish_reason": "stop", "num_tokens": 2}
        (work / "data").mkdir(parents=True, exist_ok=True)
        (work / "data" / f"{split}.jsonl").write_text(json.dumps(line) + "\n")
    run = work / "runs" / "fresh" / "ce" / "seed0"
    run.mkdir(parents=True)
    (run / "record.json").write_text('{"tokens": 768}\n')
    (run / "rows.npz").write_bytes(b"rows")
    return work


# ----------------------------------------------------------------------------- --pack


def test_pack_refuses_a_folder_that_is_not_an_earlier_pack(tool, tmp_path, capsys):
    work = _fake_work(tmp_path / "work")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("my notes\n")
    code, err = _cli(tool, ["--work", work, "--pack", notes], capsys)
    assert code == 2 and "not empty and not an earlier pack" in _one_line(err)
    assert _tree(notes) == {"notes.txt": b"my notes\n"}
    # an earlier pack is replaced, but not once a file of the user's is in it
    pack = tmp_path / "pack"
    assert _cli(tool, ["--work", work, "--pack", pack], capsys)[0] == 0
    assert _cli(tool, ["--work", work, "--pack", pack], capsys)[0] == 0
    assert json.loads(gzip.decompress((pack / "responses" / "train.jsonl.gz").read_bytes()))["text"] == "a1"
    (pack / "runs" / "notes.txt").write_text("mine\n")
    before = _tree(pack)
    code, err = _cli(tool, ["--work", work, "--pack", pack], capsys)
    assert code == 2 and f"{pack / 'runs' / 'notes.txt'}" in _one_line(err) and _tree(pack) == before
    # nor is a folder of the user's beside it, named as the pack's temporary one
    (pack / "runs" / "notes.txt").unlink()
    (tmp_path / "pack.tmp").mkdir()
    (tmp_path / "pack.tmp" / "keep.txt").write_text("keep\n")
    code, err = _cli(tool, ["--work", work, "--pack", pack], capsys)
    assert code == 2 and "pack.tmp exists and is not a pack being written" in _one_line(err)
    assert _tree(tmp_path / "pack.tmp") == {"keep.txt": b"keep\n"}


@pytest.mark.parametrize("where", ["parent", "work", "inside"])
def test_pack_refuses_a_folder_at_inside_or_above_work(tool, tmp_path, capsys, where):
    work = _fake_work(tmp_path / "study" / "w1")
    dest = {"parent": tmp_path / "study", "work": work, "inside": work / "pack"}[where]
    before = _tree(tmp_path)
    code, err = _cli(tool, ["--work", work, "--pack", dest], capsys)
    line = _one_line(err)
    assert code == 2 and line.startswith(f"--pack {dest}: ") and "--work" in line and "outside it" in line
    assert _tree(tmp_path) == before and not (tmp_path / "study.old").exists()


def test_pack_onto_a_file_is_one_line_and_leaves_it(tool, tmp_path, capsys):
    work = _fake_work(tmp_path / "work")
    file = tmp_path / "FILE"
    file.write_text("the user's\n")
    code, err = _cli(tool, ["--work", work, "--pack", file], capsys)
    assert code == 2 and _one_line(err) == (f"--pack {file} is a file, not a folder: give a new or empty folder, "
                                            "or an earlier pack")
    assert file.read_text() == "the user's\n" and sorted(p.name for p in tmp_path.iterdir()) == ["FILE", "work"]


def test_pack_on_a_read_only_file_system_and_a_full_disk(tool, tmp_path, capsys, monkeypatch):
    from bebop_megatron.study import pack as packing

    work = _fake_work(tmp_path / "work")
    pack = tmp_path / "pack"
    assert _cli(tool, ["--work", work, "--pack", pack], capsys)[0] == 0
    earlier = _tree(pack)
    (work / "runs" / "fresh" / "kl" / "seed0").mkdir(parents=True)  # something new to pack
    shutil.copy(work / "runs" / "fresh" / "ce" / "seed0" / "rows.npz", work / "runs" / "fresh" / "kl" / "seed0")
    shutil.copy(work / "runs" / "fresh" / "ce" / "seed0" / "record.json", work / "runs" / "fresh" / "kl" / "seed0")
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):  # the file system under tmp_path takes no new entry
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    code, err = _cli(tool, ["--work", work, "--pack", pack], capsys)
    assert code == 2 and _one_line(err) == f"--pack {pack}: cannot write {pack}.tmp (Read-only file system)"
    monkeypatch.setattr(os, "mkdir", real_mkdir)
    assert _tree(pack) == earlier and not (tmp_path / "pack.tmp").exists()

    real_write_gz = packing._write_gz

    def full(path, lines):  # half of the file, then the disk is full
        real_write_gz(path, lines[: len(lines) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(packing, "_write_gz", full)
    code, err = _cli(tool, ["--work", work, "--pack", pack], capsys)
    assert code == 74 and _one_line(err) == (f"--pack {pack}: no space left on device while writing "
                                             f"{pack}.tmp/responses/heldout.jsonl.gz")
    assert _tree(pack) == earlier and not (tmp_path / "pack.tmp").exists() and not (tmp_path / "pack.old").exists()


# ----------------------------------------------------------------------------- --report-only


def test_report_only_out_or_work_a_file_or_out_read_only(tool, tmp_path, capsys, monkeypatch):
    meg = tmp_path / "meg"
    meg.mkdir()
    file = tmp_path / "file"
    file.write_text("the user's\n")
    base = ["--megatron", meg, "--train-data", "a", "--heldout-data", "b", "--report-only"]
    code, err = _cli(tool, [*base, "--work", tmp_path / "w", "--out", file], capsys)
    assert code == 2 and _one_line(err) == f"--out {file} exists and is not a directory"
    code, err = _cli(tool, [*base, "--work", file], capsys)
    assert code == 2 and _one_line(err) == f"--work {file} exists and is not a directory"
    assert file.read_text() == "the user's\n" and not (tmp_path / "w").exists()
    out = tmp_path / "out"
    out.mkdir()
    real_open = builtins.open

    def read_only(path, mode="r", *args, **kwargs):  # out/ takes no write
        if str(path).startswith(str(out)) and any(m in mode for m in "wax+"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only)
    code, err = _cli(tool, [*base, "--work", tmp_path / "w", "--out", out], capsys)
    monkeypatch.setattr(builtins, "open", real_open)
    assert code == 2 and _one_line(err) == f"--out {out}: cannot write {out / 'study.log'} (Read-only file system)"
    assert list(out.iterdir()) == []
    # the disk full when the report is written: exit 74, as the trainer's
    from bebop_megatron.study import report

    def full(plan, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(plan.out / "RESULTS.md"))

    monkeypatch.setattr(report, "write_report", full)
    code, err = _cli(tool, [*base, "--work", tmp_path / "w", "--out", out], capsys)
    assert code == 74 and _one_line(err) == f"the study: no space left on device while writing {out / 'RESULTS.md'}"


def test_a_run_whose_processes_met_a_full_disk_is_exit_74(tmp_path, monkeypatch):
    """--ranks N: the run's processes stop with the trainer's exit 74 and its line; the study
    says that line and exits 74 too (it said it with exit 2)."""
    import subprocess

    from bebop_megatron.study import runs
    from bebop_megatron.study.log import StudyDiskError

    line = f"no space left on device while writing {tmp_path / 'run' / 'ckpt' / 'iter_0000001.tmp'}"

    class Ranks:  # torchrun, its ranks stopped by the disk
        def __init__(self, cmd, env, stdout, stderr):
            stderr.write(f"error: {line}\n")
            stderr.flush()

        def wait(self):
            return 74

        def poll(self):
            return 74

    monkeypatch.setattr(subprocess, "Popen", Ranks)
    with pytest.raises(StudyDiskError) as err:
        runs.launch_run(tmp_path / "run", runs.RunConfig("model.yaml", []), ranks=2, temperatures=(1.0,),
                        gamma=3, chunk_positions=64, save_head=None, verbose=False, meta=None)
    assert str(err.value) == f"{tmp_path / 'run'}: the run's 2 processes stopped: {line}"
    assert err.value.exit_code == 74


# ----------------------------------------------------------------------------- before any work


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """``(folder, hf, prompts)``: the tiny random Llama and its prompts of tests/test_objective_study.py."""
    tmp = tmp_path_factory.mktemp("reliability")
    hf, prompts = _tiny_model(tmp)
    return tmp, Path(hf), Path(prompts)


@pytest.mark.parametrize("ranks", ["1", "2"])
@pytest.mark.parametrize("flags, line", [
    (["--objectives", "e2e_tv,foo"], "--objectives: unknown objective 'foo' (loss types: "),
    (["--seq-length", "4096"], "train.seq_length=4096 is above model.max_position_embeddings=256"),
    (["--global-batch-size", "5"], "train.global_batch_size=5 must be a multiple of train.micro_batch_size=2"),
    (["--set", "train.foo=1"], "unknown config key 'train.foo'"),
    (["--precision", "fp16"], "precision='fp16' must be one of fp32, bf16, fp8"),
    (["--device", "cuda"], "--device cuda: no CUDA device is visible here; use --device cpu"),
    (["--seeds", "-1"], "--seeds: -1 is out of range; seeds are integers from 0 to 4294967294"),
    (["--prompts", "P", "--train-data", "F", "--heldout-data", "H"], "give --prompts or --train-data, not both"),
])
def test_flags_and_trainer_config_are_checked_before_any_work(tool, model, tmp_path, capsys, flags, line, ranks):
    """Each mistake is one line before the import (nothing under --work), at --ranks 1 and 2."""
    if "cuda" in flags:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is visible")
    _, hf, prompts = model
    work = tmp_path / "work"
    given = ["--prompts", prompts] if "--prompts" not in flags else []
    code, err = _cli(tool, ["--hf-dir", hf, *given, "--work", work, *SIZES, "--ranks", ranks, *flags], capsys)
    assert code == 2 and line in _one_line(err)
    assert not work.exists()


def test_ranks_the_model_cannot_split_before_the_import(tool, model, tmp_path, capsys):
    _, hf, prompts = model
    code, err = _cli(tool, ["--hf-dir", hf, "--prompts", prompts, "--work", tmp_path / "w", *SIZES, "--ranks", "4"],
                     capsys)
    assert code == 2 and _one_line(err) == (
        "--ranks 4 (tensor parallel 4): parallel.tensor=4 must divide model.num_query_groups=2")
    assert not (tmp_path / "w").exists()


# ----------------------------------------------------------------------------- a study's work folder


@pytest.fixture(scope="module")
def study(model):
    """A finished tiny study (the fresh ce run of seed 0) in ``folder/work``."""
    tmp, hf, prompts = model
    proc = forkserver.run([sys.executable, str(TOOL), "--hf-dir", str(hf), "--prompts", str(prompts), "--work",
                           str(tmp / "work"), *SIZES, "--objectives", "ce"], cwd=tmp, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return tmp, hf, prompts, tmp / "work"


def _other_model(hf: Path, dest: Path) -> Path:
    """``hf`` with one weight changed: another model of the same configuration and tokenizer."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf, dest)
    weights = load_file(str(dest / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1.0
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _state(work: Path) -> dict:
    return {str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(work.rglob("*")) if p.is_file() and p.parent.name != "report"}


def test_a_work_folder_of_another_model_or_prompts_is_refused(tool, study, tmp_path, capsys):
    tmp, hf, prompts, work = study
    before = _state(work)
    hf2 = _other_model(hf, tmp_path / "hf2")
    code, err = _cli(tool, ["--hf-dir", hf2, "--prompts", prompts, "--work", work, *SIZES, "--objectives", "ce,kl"],
                     capsys)
    assert code == 2 and _one_line(err).startswith(f"--work {work} was made from another model: {hf}, not {hf2}")
    # the same prompts but one: other answers
    other = tmp_path / "prompts"
    shutil.copytree(prompts, other)
    lines = (other / "train.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["prompt"] += " dog"
    (other / "train.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    code, err = _cli(tool, ["--hf-dir", hf, "--prompts", other, "--work", work, *SIZES, "--objectives", "ce,kl"],
                     capsys)
    assert code == 2 and _one_line(err).startswith(f"--work {work} holds the answers to other prompts")
    # --mtp-num-steps 2 on a work folder imported with 3 steps
    code, err = _cli(tool, ["--hf-dir", hf, "--prompts", prompts, "--work", work, *SIZES, "--mtp-num-steps", "2"],
                     capsys)
    assert code == 2 and _one_line(err).startswith(
        f"--mtp-num-steps 2: this work folder's import {work / 'megatron'} has mtp.num_steps=3")
    assert _state(work) == before
    # the same model and prompts in other folders (a copy): the same fingerprint, the study goes on
    same = tmp_path / "hf_copy"
    shutil.copytree(hf, same)
    code, err = _cli(tool, ["--hf-dir", same, "--prompts", prompts, "--work", work, *SIZES, "--objectives", "ce",
                            "--report-only"], capsys)
    assert code == 0, err


_FULL_DISK = '''
import errno, functools, os, runpy, sys
from megatron.core.dist_checkpointing.strategies import filesystem_async

_write_item = filesystem_async._write_item


class Full:
    """The checkpoint's file on a full disk: every write fails as the kernel's would."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.stream, name)


@functools.wraps(_write_item)  # its signature: Megatron asks it for serialization_format
def full(*args, **kwargs):
    args = list(args)
    args[-4] = Full(args[-4])  # (*transforms, stream, data, write_item, storage_key)
    return _write_item(*args, **kwargs)


if os.environ.get("FULL_AT") == "tokenize":  # the indexed dataset's writer instead
    from bebop_megatron.data import preprocess

    class FullWriter(preprocess.IndexedWriter):
        def add(self, tokens, trained):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.tmp + ".bin")

    preprocess.IndexedWriter = FullWriter
else:
    filesystem_async._write_item = full
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:  # as the interpreter's exit would (a launch of the fork server ends without it)
    import gc

    gc.collect()
'''


@pytest.mark.parametrize("stage", ["run", "import", "tokenize"])
def test_a_full_disk_is_exit_74_and_one_line(study, tmp_path, stage):
    """ENOSPC in Megatron-Core's checkpoint writer: in a run's first checkpoint (the study's
    import and responses done) and in the import of a new work folder; in the indexed dataset's
    writer (the responses tokenized again): one line, exit 74 (a SIGSEGV at exit before, in 3
    tries of 3 on a real full tmpfs; a traceback for the import; exit 2 for the tokenization),
    no partial checkpoint, import nor dataset left."""
    tmp, hf, prompts, work = study
    wrapper = tmp_path / "full_disk.py"
    wrapper.write_text(_FULL_DISK)
    if stage in ("run", "tokenize"):
        target = tmp_path / "work"
        shutil.copytree(work, target, ignore=shutil.ignore_patterns("report"))
        if stage == "tokenize":
            (target / "data" / ".heldout.tokenized").unlink()
    else:
        target = tmp_path / "new"
    proc = forkserver.run([sys.executable, str(wrapper), str(TOOL), "--hf-dir", str(hf), "--prompts", str(prompts),
                           "--work", str(target), *SIZES, "--objectives", "ce,kl"], cwd=tmp_path,
                          env={**_env(), "FULL_AT": stage}, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 74, proc.stderr[-4000:]
    assert len(errors) == 1 and "no space left on device while writing" in errors[0], proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    if stage == "run":
        run = target / "runs" / "fresh" / "kl" / "seed0"
        assert f"{run / 'ckpt'}" in errors[0] and not (run / "record.json").exists()
        assert not list(run.rglob("*.tmp")) and not list((run / "ckpt").glob("iter_*"))
        assert (target / "runs" / "fresh" / "ce" / "seed0" / "record.json").is_file()
    elif stage == "import":
        assert errors[0].startswith(f"error: import {target / 'megatron'}: no space left on device")
        assert not (target / "megatron").exists()
    else:
        assert errors[0] == (f"error: tokenize {target / 'data' / 'heldout'}: no space left on device while writing "
                             f"{target / 'data' / 'heldout'}.partial.bin")
        assert not list((target / "data").glob("*.partial*")) and not (target / "runs" / "fresh" / "kl").exists()
