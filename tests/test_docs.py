"""The documentation's links hold: README.md and docs/*.md (stdlib only, no torch).

- every relative link (``[text](path)``, ``![alt](path)``) points to a file or directory of
  the repository, and where it names a ``#fragment`` of a Markdown file, to one of that file's
  heading anchors as GitHub makes them;
- every page under docs/ is linked from the README;
- the README's quick start shows exactly the setup and test commands CI runs (``.ci/run``).

Code blocks and inline code are not Markdown, so links inside them are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))

_FENCE = re.compile(r"^ {0,3}(```+|~~~+)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or ![alt](target); the text may hold one level of nested brackets
_LINK = re.compile(r"(?<!\\)\[((?:[^\[\]\\]|\\.|\[[^\[\]]*\])*)\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _outside_fences(text: str):
    """The lines of ``text`` outside fenced code blocks."""
    fence = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        yield line


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked."""
    return [_CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line) for line in _outside_fences(text)]


def github_anchor(heading: str) -> str:
    """GitHub's heading id: the heading's text (markup removed), lower case, every character that
    is not a letter, digit, ``_``, ``-`` or space dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated one gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _outside_fences(path.read_text(encoding="utf-8")):
        h = _HEADING.match(line)
        if not h:
            continue
        base = github_anchor(h.group(2))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number in the prose, target) of every inline link and image of a Markdown file."""
    found = []
    for number, line in enumerate(_prose_lines(path.read_text(encoding="utf-8")), 1):
        for m in _LINK.finditer(line):
            target = m.group(2)
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            found.append((number, target))
    return found


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target))


def _check(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if _is_external(target):
            continue
        if not target:
            problems.append(f"{path.relative_to(REPO)}: empty link target")
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}: link to {target!r}"
        if REPO not in dest.parents and dest != REPO:
            problems.append(f"{where} leaves the repository")
        elif not dest.exists():
            problems.append(f"{where}: {dest.relative_to(REPO)} does not exist")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{where}: {dest.relative_to(REPO)} has no heading with anchor #{fragment}")
    return problems


def test_github_anchor_rules():
    assert github_anchor("Quick start") == "quick-start"
    assert github_anchor("Production runs (Slurm)") == "production-runs-slurm"
    assert github_anchor("Verification (`--verify`)") == "verification---verify"
    assert github_anchor("Qwen2.5-Coder-1.5B-Instruct on 2 CPU cores") == "qwen25-coder-15b-instruct-on-2-cpu-cores"
    assert github_anchor("GPU script: `gpu/run_all.sh`") == "gpu-script-gpurun_allsh"
    assert github_anchor("Recipe: which objective to run") == "recipe-which-objective-to-run"


def test_link_parsing_skips_code():
    text = "a [x](b.md) `[y](c.md)` E[L]\\(3)\n```\n[z](d.md)\n```\n![i](e.png \"t\")\n"
    lines = _prose_lines(text)
    targets = [m.group(2) for line in lines for m in _LINK.finditer(line)]
    assert targets == ["b.md", "e.png"]


def test_docs_exist():
    assert DOCS, "docs/ has no pages"


def test_every_relative_link_resolves():
    problems = [p for path in [README, *DOCS] for p in _check(path)]
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme():
    linked = set()
    for _, target in links(README):
        if not _is_external(target):
            linked.add((REPO / target.partition("#")[0]).resolve())
    missing = [str(p.relative_to(REPO)) for p in DOCS if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_readme_quick_start_shows_the_commands_ci_runs():
    """.ci/run runs the README's setup and test commands and the optional engine venv: the quick
    start shows exactly those (and installs Slurm for tests/test_production_slurm_real.py where it is
    missing, as root)."""
    commands = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith(("#", "set ", "cd ", "if ", "apt-get ", "fi", "PACKAGES",
                                                                  "{ command -v", "command -v"))]
    assert commands == ["python3.12 -m venv .venv && .venv/bin/pip install -e '.[test]'",
                        "tools/engines/vllm_env.sh", ".venv/bin/python -m pytest -q tests"]
    text = README.read_text(encoding="utf-8")
    quick = text[text.index("## Quick start"):]
    quick = quick[:quick.index("\n## ", 1)]
    block = quick[quick.index("```bash\n") + len("```bash\n"):]
    block_lines = block[:block.index("```")].splitlines()
    # the engine venv is the optional last line (with a comment), after the tests
    code = [line.split("#")[0].strip() for line in block_lines]
    assert code[0] == commands[0] and code[-2:] == [commands[2], commands[1]], block_lines


# ----------------------------------------------------------------------------- the registries' names


def _table_row(path: Path, first_cell: str) -> str:
    rows = [line for line in path.read_text().splitlines() if line.startswith(f"| {first_cell} ")]
    assert len(rows) == 1, f"{path.name}: one table row starting with {first_cell!r}, found {len(rows)}"
    return rows[0]


def test_data_formats_are_the_layout_registry():
    """docs/configuration.md's data.format row and tools/preprocess_data.py's --format choices name
    exactly the record layouts of bebop_megatron/config/layouts.py."""
    import importlib.util

    from bebop_megatron.config.layouts import FORMATS

    row = _table_row(REPO / "docs" / "configuration.md", "`data.format`")
    named = [name for name in re.findall(r"`([a-z_]+)`", row.split("|")[2]) if name in FORMATS]
    assert sorted(set(named)) == sorted(FORMATS)
    spec = importlib.util.spec_from_file_location("preprocess_data", REPO / "tools" / "preprocess_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    (action,) = [a for a in tool.build_parser()._actions if a.dest == "format"]
    assert tuple(action.choices) == FORMATS


def test_objectives_table_is_the_objective_registry():
    """docs/objectives.md's table lists the registry's objectives, in its order, with its lines."""
    from bebop_megatron.losses.objectives import DEFAULT, OBJECTIVES

    text = (REPO / "docs" / "objectives.md").read_text()
    start = text.index("| `loss.type` | what it minimises |")
    rows = text[start:text.index("\n\n", start)].splitlines()[2:]
    assert rows == [f"| `{n}`{' (default)' if n == DEFAULT else ''} | {o.doc} |" for n, o in OBJECTIVES.items()]
