"""What a study's work folder was made from: ``WORK/fingerprint.json``.

A work folder holds the import of one model, that model's answers to one set of prompts and
the runs trained on them; every stage resumes from what is there. Run again with another model
(``--hf-dir``, ``--model``, ``--megatron``) or other prompts (``--prompts``, ``--num-train``,
``--num-heldout``), the stages would silently reuse them. So the first study in a folder records
their fingerprints, and a later one whose fingerprints differ is refused in one line before it
writes anything.

- a model folder: per file at its top (config, tokenizer, chat template, weights; not hidden
  files nor README/LICENSE), its name, size and the sha256 of its first and last MiB (the whole
  file when smaller): cheap on a model of many GB, and any other checkpoint differs;
- an import given with ``--megatron``: the same over its files;
- the prompts: the sha256 of the study's prompt sets (ids, messages and carried fields, per split).

A folder in which nothing was made yet (no import, responses, runs nor heads) takes the new
fingerprints; a fingerprint not recorded before (e.g. ``--prompts`` after ``--train-data``) is
added.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from bebop_megatron.platform.atomic import write_atomic
from bebop_megatron.study.log import StudyError

FILE = "fingerprint.json"
SAMPLE = 1 << 20  # bytes hashed at each end of a large file
PRODUCTS = ("megatron", "data", "runs", "heads")  # what the stages make in a work folder
_SKIPPED = (".", "README", "LICENSE", "NOTICE")


def _file_digest(path: Path, h) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if size <= 2 * SAMPLE:
            h.update(f.read())
        else:
            h.update(f.read(SAMPLE))
            f.seek(size - SAMPLE)
            h.update(f.read(SAMPLE))


def folder_fingerprint(folder: Path, *, recursive: bool = False) -> dict:
    """``{"folder": the folder, "sha256": its files' fingerprint}``."""
    folder = Path(folder).resolve()
    h = hashlib.sha256()
    files = folder.rglob("*") if recursive else folder.iterdir()
    for path in sorted(p for p in files if p.is_file() and not p.name.startswith(_SKIPPED)
                       and not p.name.endswith(".md")):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        _file_digest(path, h)
    return {"folder": str(folder), "sha256": h.hexdigest()}


def prompts_fingerprint(sets: dict, given: str) -> dict:
    """``{"given": what the user gave, "sha256": the prompt sets' fingerprint}``."""
    body = {split: [[p.key, p.messages, p.extra] for p in prompts] for split, prompts in sorted(sets.items())}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()
    return {"given": given, "sha256": digest}


WHAT = {
    "model": ("was made from another model", "--model/--hf-dir"),
    "import": ("was made with another import", "--megatron"),
    "prompts": ("holds the answers to other prompts", "--prompts/--num-train/--num-heldout"),
}


def read(work: Path) -> dict:
    path = Path(work) / FILE
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # cut by a kill: written again
    return value if isinstance(value, dict) else {}


def made_anything(work: Path) -> bool:
    return any((Path(work) / name).exists() for name in PRODUCTS)


def check(work: Path, current: dict) -> dict:
    """Refuse ``current`` (``{"model"|"import"|"prompts": fingerprint or None}``) when ``work``
    was made from others; returns what to record (:func:`record`)."""
    stored = read(work) if made_anything(work) else {}
    for key, (what, flags) in WHAT.items():
        mine, theirs = current.get(key), stored.get(key)
        if mine is None or theirs is None or mine["sha256"] == theirs["sha256"]:
            continue
        was = theirs.get("folder") or theirs.get("given")
        now = mine.get("folder") or mine.get("given")
        same = " (the same path, other contents)" if was == now else ""
        raise StudyError(f"--work {work} {what}: {was}, not {now}{same} ({flags}; its {FILE}); give another "
                         f"--work, or the {key} it was made from")
    return {**stored, **{k: v for k, v in current.items() if v is not None}}


def record(work: Path, fingerprint: dict) -> None:
    if read(work) != fingerprint:
        write_atomic(Path(work) / FILE, json.dumps(fingerprint, indent=1, sort_keys=True) + "\n")
