"""``tools/objective_study.py --pack`` and ``--unpack`` (:mod:`bebop_megatron.study.pack`): a study
carried to another machine without weights nor prompt text.

One tiny study for the module (tests/test_objective_study.py's random tiny Llama and sizes, run
once, uninterrupted), packed; then: the pack holds no prompt text; an unpack into a fresh work
folder with the same prompts gives the original response files byte for byte, the runs' files,
a study that trains nothing and the same report (but its machine line); other prompts or
another chat template are refused in one line before anything is written; packing twice gives
the same bytes; the options' mistakes are one line.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import sys

import pytest

from tests.helpers import forkserver
from tests.helpers.launch import REPO
from tests.test_objective_study import STUDY, _command, _env, _tiny_model

SPLITS = ("heldout", "train")  # the prompt sets
RESPONSE_SPLITS = (*SPLITS, "heldout_t0p7")  # the responses: also the held-out prompts answered at T=0.7
RUN_FILES = ("record.json", "rows.npz")


def _tool(*args, cwd):
    return forkserver.run([sys.executable, str(REPO / "tools" / "objective_study.py"), *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=600)


def _study_args(tmp, work, *, prompts=None, hf=None):
    return ["--hf-dir", str(hf or tmp / "hf"), "--prompts", str(prompts or tmp / "prompts"), "--work", str(work), *STUDY]


def _run_files(work):
    return {str(p.relative_to(work)): p.read_bytes() for name in RUN_FILES for p in (work / "runs").rglob(name)}


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """``(folder, pack)``: the tiny study of tests/test_objective_study.py finished in
    ``folder/work`` (8 runs), packed into ``folder/pack``."""
    tmp = tmp_path_factory.mktemp("pack")
    _tiny_model(tmp)
    proc = forkserver.run(_command(tmp), cwd=tmp, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    proc = _tool("--work", str(tmp / "work"), "--pack", str(tmp / "pack"), cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "8 finished runs" in proc.stdout
    return tmp, tmp / "pack"


def test_the_pack_holds_no_prompt_text(packed):
    tmp, pack = packed
    prompts = [json.loads(line)["prompt"] for s in SPLITS for line in (tmp / "prompts" / f"{s}.jsonl").read_text()
               .splitlines()]
    for split in RESPONSE_SPLITS:
        text = gzip.decompress((pack / "responses" / f"{split}.jsonl.gz").read_bytes()).decode()
        assert not any(p in text for p in prompts)
        originals = (tmp / "work" / "data" / f"{split}.jsonl").read_bytes().splitlines(keepends=True)
        lines = [json.loads(line) for line in text.splitlines()]
        assert len(lines) == len(originals) > 0
        for line, raw in zip(lines, originals, strict=True):
            assert "prompt_ids" not in line and "messages" not in line
            original = json.loads(raw)
            assert line["sha256"] == hashlib.sha256(raw).hexdigest()
            assert (line["id"], line["sample"], line["text"], line["response_ids"], line["finish_reason"],
                    line["num_tokens"]) == (original["id"], original["sample"], original["messages"][-1]["content"],
                                            original["response_ids"], original["finish_reason"],
                                            original["num_tokens"])
    manifest = json.loads((pack / "MANIFEST.json").read_text())
    assert {s: v["lines"] for s, v in manifest["splits"].items()} == {
        s: len((tmp / "work" / "data" / f"{s}.jsonl").read_text().splitlines()) for s in RESPONSE_SPLITS}
    assert len(manifest["runs"]) == 8 and manifest["responses_complete"] is True
    assert manifest["machine"]["cores"] >= 1 and manifest["machine"]["cpu"] and "torch" in manifest["machine"]
    assert "WORK/heads" in manifest["not_packed"] and "retrained" in manifest["not_packed"]
    assert (pack / "responses" / ".complete").is_file() and (pack / "responses" / "responses.json").is_file()
    assert _run_files(pack) == _run_files(tmp / "work")
    assert not list(pack.rglob("*.safetensors")) and not (pack / "heads").exists() and not (pack / "megatron").exists()


def test_unpack_gives_back_the_study(packed, tmp_path):
    """A fresh work folder, the same prompts and model: the response files byte for byte, the runs'
    files, nothing trained nor generated, the same report (but its machine line)."""
    tmp, pack = packed
    work = tmp_path / "work"
    proc = _tool(*_study_args(tmp, work), "--unpack", str(pack), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for split in RESPONSE_SPLITS:
        assert (work / "data" / f"{split}.jsonl").read_bytes() == (tmp / "work" / "data" / f"{split}.jsonl").read_bytes()
    assert _run_files(work) == _run_files(tmp / "work")
    assert "8 finished, 0 to run" in proc.stdout
    assert "responses (" not in proc.stdout and "[1/8]" not in proc.stdout and not (work / "heads").exists()
    provenance = [json.loads(line) for line in (work / "provenance.jsonl").read_text().splitlines()]
    assert len(provenance) == 1 and provenance[0]["manifest"] == json.loads((pack / "MANIFEST.json").read_text())
    # the report of the unpacked study against the original's, both written again here
    for w in (tmp / "work", work):
        report = _tool(*_study_args(tmp, w), "--report-only", cwd=tmp_path)
        assert report.returncode == 0, report.stdout[-4000:] + report.stderr[-4000:]
    original = (tmp / "work" / "report" / "RESULTS.md").read_text()
    unpacked = (work / "report" / "RESULTS.md").read_text()
    machine = [line for line in unpacked.splitlines() if line.startswith("Machine")]
    assert len(machine) == 1 and "every run on" in machine[0] and provenance[0]["manifest"]["machine"]["cpu"] in machine[0]
    assert "Machine" not in original  # no provenance.jsonl: no machine line
    assert unpacked.replace(machine[0] + "\n\n", "") == original
    # unpacked again into the same folder: everything is already there, nothing changes
    again = _tool(*_study_args(tmp, work), "--unpack", str(pack), "--report-only", cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "0 finished runs restored, 8 already here" in again.stdout
    assert _run_files(work) == _run_files(tmp / "work")


def _changed_prompts(tmp, dest):
    shutil.copytree(tmp / "prompts", dest)
    lines = (dest / "heldout.jsonl").read_text().splitlines()
    first = json.loads(lines[1])
    first["prompt"] += " dog"
    lines[1] = json.dumps(first)
    (dest / "heldout.jsonl").write_text("\n".join(lines) + "\n")
    return first["id"]


def test_unpack_with_other_prompts_is_refused_before_any_write(packed, tmp_path):
    tmp, pack = packed
    changed = _changed_prompts(tmp, tmp_path / "prompts")
    work = tmp_path / "work"
    proc = _tool(*_study_args(tmp, work, prompts=tmp_path / "prompts"), "--unpack", str(pack), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: --unpack ")
    assert f"heldout response 2 (id \"{changed}\")" in proc.stderr and "its prompt differs" in proc.stderr
    assert "check --prompts" in proc.stderr
    assert not (work / "data").exists() and not (work / "runs").exists() and not (work / "provenance.jsonl").exists()


def test_unpack_with_another_chat_template_is_refused(packed, tmp_path):
    tmp, pack = packed
    hf = tmp_path / "hf"
    shutil.copytree(tmp / "hf", hf)
    template = hf / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|assistant|> ", "<|assistant|> <|assistant|> "))
    work = tmp_path / "work"
    proc = _tool(*_study_args(tmp, work, hf=hf), "--unpack", str(pack), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: --unpack ") and "heldout response 1" in proc.stderr
    assert "prompt_ids differ" in proc.stderr
    assert not (work / "data").exists() and not (work / "runs").exists() and not (work / "provenance.jsonl").exists()


def test_a_finished_run_of_another_record_is_refused(packed, tmp_path):
    tmp, pack = packed
    work = tmp_path / "work"
    run = work / "runs" / "fresh" / "e2e_tv" / "seed1"
    shutil.copytree(tmp / "work" / "runs" / "fresh" / "e2e_tv" / "seed1", run)
    record = json.loads((run / "record.json").read_text())
    record["train_s"] += 1
    (run / "record.json").write_text(json.dumps(record))
    proc = _tool(*_study_args(tmp, work), "--unpack", str(pack), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: --unpack {pack}: {run} holds a finished run whose record.json differs")
    assert not (work / "data").exists() and not (work / "provenance.jsonl").exists()
    assert sorted(p.relative_to(work) for p in work.rglob("record.json")) == [run.relative_to(work) / "record.json"]


def test_packing_twice_gives_the_same_bytes(packed, tmp_path):
    """Into a new folder and over the existing pack (replaced): every file the same bytes; the
    manifest differs in its date at most."""
    tmp, pack = packed
    before = _tree(pack)
    for dest in (tmp_path / "again", pack):
        proc = _tool("--work", str(tmp / "work"), "--pack", str(dest), cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        after = _tree(dest)
        assert sorted(after) == sorted(before)
        for name in before:
            if name == "MANIFEST.json":
                a, b = json.loads(before[name]), json.loads(after[name])
                a.pop("date"), b.pop("date")
                assert a == b
            else:
                assert after[name] == before[name], name
    assert not (tmp / "pack.tmp").exists() and not (tmp / "pack.old").exists()


def test_option_mistakes_are_one_line(packed, tmp_path):
    tmp, pack = packed
    proc = _tool(*_study_args(tmp, tmp_path / "w"), "--pack", str(tmp_path / "p"), "--unpack", str(pack),
                 cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == (
        "error: give --pack or --unpack, not both (--pack writes --work's state into DIR and stops; --unpack "
        "restores a pack into --work before the study)\n")
    assert not (tmp_path / "p").exists() and not (tmp_path / "w").exists()
    proc = _tool(*_study_args(tmp, tmp_path / "w"), "--unpack", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == (
        f"error: --unpack {tmp_path}: no MANIFEST.json (not a folder written by --pack)\n")
    proc = _tool("--work", str(tmp_path / "none"), "--pack", str(tmp_path / "p"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "nothing to pack" in proc.stderr
