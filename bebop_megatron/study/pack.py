"""Carrying an objective study to another machine: ``--pack DIR`` and ``--unpack DIR``.

A study's work folder holds weights (the import ``WORK/megatron``, the existing condition's ce
heads ``WORK/heads``) and the prompts' text (in every response line), neither of which may be
committed; the rest is small. :func:`pack` writes that rest into ``DIR``:

- ``responses/<split>.jsonl.gz``: per line of ``WORK/data/<split>.jsonl``, what the prompt does
  not give back: ``id``, ``sample``, ``text`` (the assistant's answer), ``response_ids``,
  ``finish_reason``, ``num_tokens``, ``sha256`` (of the original line's bytes), and two checks
  of what is left out, ``prompt_sha256`` (of the prompt's messages and carried fields) and
  ``prompt_ids_sha256``; gzip with mtime 0, so packing the same state twice gives the same bytes;
- ``responses/``: the responses stage's ``responses.json`` and ``.complete`` marker and any
  generation settings file (``<split>.jsonl.settings.json``), as they are;
- ``runs/<condition>/<objective>/seed<S>/{record.json, rows.npz}`` of every finished run;
- ``MANIFEST.json``: what was packed (splits and their lines, runs with their files' sha256 and
  the machine each was made on), the packing machine, the date, the git commit.

:func:`unpack` rebuilds ``WORK/data/<split>.jsonl`` from ``DIR`` and the study's prompt sets:
each packed line joined with its prompt, the prompt's ids rendered by the import's tokenizer as
the generator did (:func:`bebop_megatron.data.generate_hf.chat_prompt_ids`), the line written
as the generator writes it (:func:`bebop_megatron.data.generate.output_line`), and its sha256
checked against the packed one; any mismatch stops with one line, before anything is written.
Then the stage marker, the settings files and the finished runs are restored, and the pack's
manifest is appended to ``WORK/provenance.jsonl`` (the report names the machine of each run).
The ce heads of the existing condition are not packed: they are retrained after an unpack when
an existing run is still to run.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

from bebop_megatron.platform import cpu_model
from bebop_megatron.platform.atomic import write_atomic
from bebop_megatron.study.log import StudyError, log, write_error
from bebop_megatron.study.stages import DONE, SPLITS, is_heldout, splits_on_file

FORMAT = 1
MANIFEST = "MANIFEST.json"
PROVENANCE = "provenance.jsonl"
RESPONSES_FILE = "responses.json"
RUN_FILES = ("rows.npz", "record.json")  # written in this order: record.json last marks a run finished
NOT_PACKED = ("WORK/megatron (the import: weights; the study imports the model again) and WORK/heads (the "
              "existing condition's ce heads: weights; retrained after an unpack when an existing run is still "
              "to run); the prompts' text and prompt_ids (rebuilt from --prompts and the model's tokenizer)")
# What a packed line keeps of the generator's output line (bebop_megatron.data.generate.output_record).
OUTPUT_KEYS = ("id", "sample", "messages", "prompt_ids", "response_ids", "finish_reason", "num_tokens")


# ----------------------------------------------------------------------------- machines


def machine() -> dict:
    """This machine: CPU model (``/proc/cpuinfo``'s ``model name``), cores, torch, Python, platform."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"cpu": cpu_model() or "unknown", "cores": os.cpu_count(),
            "torch": torch_version, "python": platform.python_version(), "platform": platform.platform()}


def describe(m: dict) -> str:
    return f"{m.get('cpu')} ({m.get('cores')} cores; torch {m.get('torch')}; {m.get('platform')})"


def _git() -> dict | None:
    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30)
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_provenance(work: Path) -> list[dict]:
    """The entries of ``WORK/provenance.jsonl`` (one per unpack), oldest first; [] when absent."""
    path = Path(work) / PROVENANCE
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def run_machines(work: Path, names) -> dict:
    """``{run name: machine or None}``: the machine a finished run (``condition/objective/seedS``)
    was made on, by the latest unpack that brought this very record (its sha256); None: not
    unpacked, so made in this work folder."""
    entries = read_provenance(work)
    out = {}
    for name in names:
        record = Path(work) / "runs" / name / "record.json"
        sha = _sha256_file(record) if record.is_file() else None
        out[name] = None
        for entry in reversed(entries):
            run = ((entry.get("manifest") or {}).get("runs") or {}).get(name) or {}
            if sha is not None and run.get("record_sha256") == sha:
                out[name] = run.get("made_on")
                break
    return out


# ----------------------------------------------------------------------------- files


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _prompt_sha(messages: list, extra: dict) -> str:
    return _sha256(json.dumps({"messages": messages, "extra": extra}, sort_keys=True, ensure_ascii=False)
                   .encode("utf-8"))


def _ids_sha(ids: list) -> str:
    return _sha256(json.dumps(ids).encode())


def finished_runs(work: Path) -> list[str]:
    """``condition/objective/seedS`` of every finished run in ``WORK/runs``, sorted."""
    from bebop_megatron.study.runs import is_finished

    runs = Path(work) / "runs"
    return sorted(str(p.relative_to(runs)) for p in runs.glob("*/*/seed*") if p.is_dir() and is_finished(p))


def packed_line(raw: bytes, where: str) -> bytes:
    """One output line of the generator without what its prompt gives back (JSON, newline ended)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages or messages[-1].get("role") != "assistant":
            raise ValueError("its last message is not the assistant's")
        packed = {"id": obj["id"], "sample": obj["sample"], "text": messages[-1]["content"]}
        if "response_ids" in obj:
            packed["response_ids"] = obj["response_ids"]
        packed["finish_reason"], packed["num_tokens"] = obj["finish_reason"], obj["num_tokens"]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise StudyError(f"{where}: not a line of the responses stage ({type(err).__name__}: {err})") from None
    extra = {k: v for k, v in obj.items() if k not in OUTPUT_KEYS}
    packed["prompt_sha256"] = _prompt_sha(messages[:-1], extra)
    if "prompt_ids" in obj:
        packed["prompt_ids_sha256"] = _ids_sha(obj["prompt_ids"])
    packed["sha256"] = _sha256(raw)
    return (json.dumps(packed, ensure_ascii=False) + "\n").encode("utf-8")


def _write_gz(path: Path, lines: list[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as gz:
        for line in lines:
            gz.write(line)


def _read_gz_lines(path: Path) -> list[bytes]:
    with gzip.open(path, "rb") as f:
        return [line for line in f.read().splitlines(keepends=True) if line.strip()]


# ----------------------------------------------------------------------------- pack


PACK_WHAT = "tools/objective_study.py --pack"


def _pack_problem(folder: Path, *, partial: bool = False) -> str | None:
    """What in ``folder`` a :func:`pack` did not write (None: every entry is a pack's; ``partial``:
    a pack being built, whose ``MANIFEST.json``, written last, may be missing)."""
    manifest = folder / MANIFEST
    if manifest.is_file() and not manifest.is_symlink():
        try:
            what = json.loads(manifest.read_text()).get("what", "")
        except (OSError, ValueError, AttributeError):
            what = ""
        if not str(what).startswith(PACK_WHAT):
            return f"its {MANIFEST} is not one of {PACK_WHAT}"
    elif not partial:
        return f"no {MANIFEST} of {PACK_WHAT}"
    for entry in sorted(folder.rglob("*")):
        parts = entry.relative_to(folder).parts
        if entry.is_symlink():
            return f"{entry} (a symbolic link)"
        if entry.is_dir():
            ok = parts[0] in ("responses", "runs") and (parts[0] == "runs" and len(parts) <= 4 or len(parts) == 1) \
                and (len(parts) < 4 or parts[3].startswith("seed"))
        else:
            ok = parts == (MANIFEST,) or len(parts) == 2 and parts[0] == "responses" and (
                parts[1] in (RESPONSES_FILE, DONE) or parts[1].endswith((".jsonl.gz", ".jsonl.settings.json"))) \
                or len(parts) == 5 and parts[0] == "runs" and parts[3].startswith("seed") and parts[4] in RUN_FILES
        if not ok:
            return str(entry)
    return None


def check_destination(work: Path, dest: Path) -> None:
    """Before anything is written: ``dest`` (absolute) may take a pack of ``work``. Refused: ``dest``
    (or the ``.tmp`` and ``.old`` beside it, which a pack writes and deletes) at, inside or above
    ``work``; a file; a folder holding anything but an earlier pack (an empty one is fine)."""
    tmp, old = dest.with_name(dest.name + ".tmp"), dest.with_name(dest.name + ".old")
    here = work.resolve()
    for path in (dest, tmp, old):
        path = path.resolve()
        if path == here or here in path.parents or path in here.parents:
            where = "is --work" if path == here else "is inside --work" if here in path.parents else "holds --work"
            raise StudyError(f"--pack {dest}: {path} {where} {work} (a pack replaces its folder); give a folder "
                             "outside it")
    probe = dest
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        probe = probe.parent
    if probe != dest and not probe.is_dir():
        raise StudyError(f"--pack {dest}: {probe} is not a folder")
    if dest.exists() and not dest.is_dir():
        raise StudyError(f"--pack {dest} is a file, not a folder: give a new or empty folder, or an earlier pack")
    if dest.is_dir() and any(dest.iterdir()):
        problem = _pack_problem(dest)
        if problem:
            raise StudyError(f"--pack {dest}: not empty and not an earlier pack ({problem}); give a new or empty "
                             "folder, or an earlier pack to replace")
    for path, partial in ((tmp, True), (old, False)):
        if path.exists() or path.is_symlink():
            problem = "a file" if not path.is_dir() or path.is_symlink() else _pack_problem(path, partial=partial)
            if problem:
                raise StudyError(f"--pack {dest}: {path} exists and is not " + (
                    "a pack being written" if partial else "an earlier pack") + f" ({problem}); move it away")


def pack(work: Path, dest: Path, *, prompts: Path | None = None) -> dict:
    """Write ``work``'s portable state into ``dest`` (replaced atomically: built in ``dest.tmp``,
    then swapped in); returns the manifest. Nothing but an earlier pack is ever replaced or
    deleted (:func:`check_destination`); a failed write removes what it wrote (a full disk:
    :class:`~bebop_megatron.study.log.StudyDiskError`, exit 74) and leaves ``dest`` as it was."""
    work, dest = Path(work).absolute(), Path(dest).absolute()
    if not work.is_dir():
        raise StudyError(f"--pack: --work {work} is no folder: nothing to pack")
    check_destination(work, dest)
    tmp, old = dest.with_name(dest.name + ".tmp"), dest.with_name(dest.name + ".old")
    try:
        if not dest.exists() and old.exists():  # a pack killed between its two renames: the old pack comes back
            os.rename(old, dest)
        shutil.rmtree(tmp, ignore_errors=True)  # a pack being written, killed (check_destination)
        tmp.mkdir(parents=True)
        manifest = _write_pack(work, tmp, prompts)
        if dest.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(dest, old)
            try:
                os.rename(tmp, dest)
            except BaseException:
                os.rename(old, dest)
                raise
            shutil.rmtree(old)
        else:
            os.rename(tmp, dest)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # written here: removed (a full disk gets its space back)
        if isinstance(err, OSError):
            raise write_error(err, f"--pack {dest}") from None
        raise
    log(f"pack: {dest}: " + (", ".join(f"{s} {v['lines']} responses" for s, v in manifest["splits"].items())
                             or "no responses")
        + f", {len(manifest['runs'])} finished runs (not packed: the import and the heads; MANIFEST.json)")
    return manifest


def _write_pack(work: Path, tmp: Path, prompts: Path | None) -> dict:
    data = work / "data"
    splits = {}
    for split in splits_on_file(data):
        src = data / f"{split}.jsonl"
        if not src.is_file():
            continue
        lines, partial = [], False
        with open(src, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):  # a write cut by a kill: the generator cuts it off on resume
                    partial = True
                    break
                if raw.strip():
                    lines.append(packed_line(raw, f"{src}:{lineno}"))
        _write_gz(tmp / "responses" / f"{split}.jsonl.gz", lines)
        splits[split] = {"lines": len(lines), "partial_last_line_left_out": partial}
        settings = Path(str(src) + ".settings.json")
        if settings.is_file():
            shutil.copyfile(settings, tmp / "responses" / settings.name)
    stage = {}
    for name in (RESPONSES_FILE, DONE):
        if (data / name).is_file():
            (tmp / "responses").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(data / name, tmp / "responses" / name)
            stage[name] = True
    here = machine()
    names = finished_runs(work)
    made_on = run_machines(work, names)
    runs = {}
    for name in names:
        folder, out = work / "runs" / name, tmp / "runs" / name
        out.mkdir(parents=True)
        for file in RUN_FILES:
            shutil.copyfile(folder / file, out / file)
        runs[name] = {"record_sha256": _sha256_file(out / "record.json"),
                      "rows_sha256": _sha256_file(out / "rows.npz"), "made_on": made_on[name] or here}
    manifest = {"format": FORMAT, "what": f"{PACK_WHAT}: the portable state of a study "
                                          "(docs/study.md#carrying-a-study-to-another-machine)",
                "date": _now(), "machine": here, "git": _git(), "work": str(work),
                "splits": splits, "responses_complete": DONE in stage, "runs": runs, "not_packed": NOT_PACKED}
    if prompts is not None and (Path(prompts) / "manifest.json").is_file():  # benchmarks/real_model/prompts.py's
        try:
            manifest["prompts_manifest"] = json.loads((Path(prompts) / "manifest.json").read_text())
        except (OSError, ValueError):
            pass
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


# ----------------------------------------------------------------------------- unpack


def read_manifest(src: Path) -> dict:
    path = Path(src) / MANIFEST
    if not path.is_file():
        old = Path(src).with_name(Path(src).name + ".old")
        raise StudyError(f"--unpack {src}: no {MANIFEST} (not a folder written by --pack)"
                         + (f"; {old} is the previous pack of a --pack killed while it swapped them"
                            if (old / MANIFEST).is_file() else ""))
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise StudyError(f"--unpack {src}: cannot read {MANIFEST} ({' '.join(str(err).split())})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StudyError(f"--unpack {src}: {MANIFEST} is not of format {FORMAT} (another version of --pack?)")
    return manifest


def rebuild_split(src: Path, split: str, prompts: list, tokenizer) -> list[bytes]:
    """The original lines of ``split``: each packed line joined with its prompt, checked (sha256)."""
    from bebop_megatron.data.generate import Completion, Job, output_line
    from bebop_megatron.data.generate_hf import chat_prompt_ids

    by_key = {p.key: p for p in prompts}
    ids_cache: dict = {}
    check = ("check --prompts (the same prompts: the prompt packages' versions, --num-train/--num-heldout) and the "
             "model's tokenizer against the pack's MANIFEST.json")
    out = []
    for n, raw in enumerate(_read_gz_lines(src / "responses" / f"{split}.jsonl.gz"), start=1):
        rec = json.loads(raw)
        key = json.dumps(rec["id"])
        where = f"--unpack {src}: {split} response {n} (id {key})"
        prompt = by_key.get(key)
        if prompt is None:
            raise StudyError(f"{where}: no prompt of that id in the study's {split} prompts; {check}")
        if _prompt_sha(prompt.messages, prompt.extra) != rec["prompt_sha256"]:
            raise StudyError(f"{where}: its prompt differs from the one the packed response answered; {check}")
        ids = None
        if "response_ids" in rec:
            if key not in ids_cache:
                try:
                    ids_cache[key] = chat_prompt_ids(tokenizer, prompt.messages)
                except Exception as err:  # a template that rejects the conversation
                    raise StudyError(f"{where}: the chat template failed ({type(err).__name__}: "
                                     f"{' '.join(str(err).split())[:200]})") from None
            ids = ids_cache[key]
            if _ids_sha(ids) != rec.get("prompt_ids_sha256"):
                raise StudyError(f"{where}: its prompt_ids differ from the generator's (another tokenizer or chat "
                                 "template: check --model/--hf-dir and transformers' version against the pack's "
                                 "MANIFEST.json)")
        result = Completion(rec["text"], rec["finish_reason"], rec["num_tokens"], prompt_ids=ids,
                            response_ids=rec.get("response_ids"))
        line = output_line(Job(prompt, rec["sample"], 0), result)
        if _sha256(line) != rec["sha256"]:
            raise StudyError(f"{where}: the rebuilt line differs from the original one (sha256); {check}")
        out.append(line)
    return out


def _complete_lines(data: bytes) -> bytes:
    """``data`` less a last line cut by a kill (no newline)."""
    return data if data.endswith(b"\n") or not data else data[:data.rfind(b"\n") + 1]


def unpack(work: Path, src: Path, *, sets: dict | None, hf: Path | None) -> dict:
    """Restore ``src`` (a :func:`pack`) into ``work``: every check first, then the writes; returns
    what was restored. ``sets``: the study's prompt sets (:func:`bebop_megatron.study.stages.prompt_sets`),
    ``hf``: the model folder whose tokenizer rendered the prompts (both needed when the pack holds
    responses). A finished run already in ``work`` is left alone (its record must be the packed
    one); a response file already in ``work`` is kept when the pack's lines begin it (it went further)
    and replaced when it begins the pack's; any other difference is refused."""
    work, src = Path(work), Path(src)
    manifest = read_manifest(src)
    data = work / "data"
    writes: list[tuple[Path, bytes]] = []
    removes: list[Path] = []
    splits = manifest.get("splits") or {}
    same_as_pack = True
    if splits:
        if sets is None or hf is None:
            raise StudyError(f"--unpack {src}: the pack holds responses; give --prompts and --model or --hf-dir, as "
                             "for the study that made it (the prompts and their ids are rebuilt from them)")
        from bebop_megatron.data.generate_hf import load_chat_tokenizer

        try:
            tokenizer = load_chat_tokenizer(str(hf), f"--unpack: {hf}")
        except ValueError as err:
            raise StudyError(str(err)) from None
        for split in splits:
            if split not in SPLITS and not is_heldout(split):
                raise StudyError(f"--unpack {src}: unknown split {split!r} in {MANIFEST}")
            lines = rebuild_split(src, split, sets["heldout" if is_heldout(split) else split], tokenizer)
            if len(lines) != splits[split]["lines"]:
                raise StudyError(f"--unpack {src}: {split}: {len(lines)} packed lines, {MANIFEST} says "
                                 f"{splits[split]['lines']} (a damaged pack)")
            blob = b"".join(lines)
            path = data / f"{split}.jsonl"
            settings = src / "responses" / f"{split}.jsonl.settings.json"
            if path.is_file():
                have = _complete_lines(path.read_bytes())
                if have == blob:
                    if settings.is_file() and not Path(str(path) + ".settings.json").is_file():
                        writes.append((Path(str(path) + ".settings.json"), settings.read_bytes()))
                    continue
                if have.startswith(blob):  # this work folder went further than the pack
                    same_as_pack = False
                    continue
                if not blob.startswith(have):
                    raise StudyError(f"--unpack {src}: {path} holds other {split} responses than the pack's: give "
                                     f"another --work (or delete {path})")
            writes.append((path, blob))
            removes.append(data / f".{split}.tokenized")  # tokenized again
            if settings.is_file():
                writes.append((Path(str(path) + ".settings.json"), settings.read_bytes()))
        if same_as_pack and not (data / DONE).is_file():
            for name in (RESPONSES_FILE, DONE):
                if (src / "responses" / name).is_file():
                    writes.append((data / name, (src / "responses" / name).read_bytes()))
    from bebop_megatron.study.runs import is_finished

    restored, kept = [], []
    for name, entry in sorted((manifest.get("runs") or {}).items()):
        packed, folder = src / "runs" / name, work / "runs" / name
        files = {f: (packed / f).read_bytes() if (packed / f).is_file() else None for f in RUN_FILES}
        if files["record.json"] is None or files["rows.npz"] is None or \
                _sha256(files["record.json"]) != entry.get("record_sha256") or \
                _sha256(files["rows.npz"]) != entry.get("rows_sha256"):
            raise StudyError(f"--unpack {src}: runs/{name}: its files are missing or differ from {MANIFEST}'s sha256 "
                             "(a damaged pack)")
        if is_finished(folder):
            if (folder / "record.json").read_bytes() != files["record.json"]:
                raise StudyError(f"--unpack {src}: {folder} holds a finished run whose record.json differs from the "
                                 "pack's: give another --work (or delete that folder)")
            kept.append(name)
            continue
        writes += [(folder / f, files[f]) for f in RUN_FILES]  # record.json last
        restored.append(name)
    # Every check passed: now the writes.
    for path in removes:
        path.unlink(missing_ok=True)
    for path, blob in writes:
        write_atomic(path, blob)
    work.mkdir(parents=True, exist_ok=True)
    with open(work / PROVENANCE, "a") as f:
        f.write(json.dumps({"unpacked_at": _now(), "pack": str(src), "unpacked_on": machine(),
                            "manifest": manifest}, sort_keys=True) + "\n")
    rebuilt = [str(p.relative_to(work)) for p, _ in writes if p.suffix == ".jsonl"]
    log(f"unpack: {src} ({manifest.get('date')}, {describe(manifest.get('machine') or {})}): "
        f"{', '.join(rebuilt) or 'no response file'} rebuilt and checked, {len(restored)} finished runs restored"
        + (f", {len(kept)} already here" if kept else "") + f"; {PROVENANCE} appended")
    return {"rebuilt": rebuilt, "restored": restored, "kept": kept}
