"""The tools are doors over the package: small (a line budget each), and every one is also a console
script (setup.py): ``tools/x_y.py`` -> ``bebop-x-y``, its ``cli()``.

The installed entry points are read from the distribution's metadata (what ``pip install -e .``
wrote), so a tool added without reinstalling, or an entry point that names a missing function,
fails here; the script and ``python tools/...`` give the same one-line error for the same mistake.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from importlib.metadata import distribution
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted(p.stem for p in (ROOT / "tools").glob("*.py") if p.stem != "__init__")
BUDGET = {"eval_acceptance": 200}  # lines; every other tool 300


def test_tools_are_within_their_line_budgets():
    """The logic lives in bebop_megatron/; a tool parses its flags, checks them and calls the package."""
    over = {t: n for t in TOOLS if (n := len((ROOT / "tools" / f"{t}.py").read_text().splitlines()))
            > BUDGET.get(t, 300)}
    assert not over, f"tools over their line budget ({BUDGET}, else 300): {over}"


def test_every_tool_is_a_console_script_of_its_cli():
    eps = {ep.name: ep for ep in distribution("bebop_megatron").entry_points if ep.group == "console_scripts"}
    assert sorted(eps) == sorted(f"bebop-{t.replace('_', '-')}" for t in TOOLS)
    for tool in TOOLS:
        ep = eps[f"bebop-{tool.replace('_', '-')}"]
        assert ep.value == f"bebop_tools.{tool}:cli"
        func = ep.load()
        assert Path(sys.modules[func.__module__].__file__).resolve() == ROOT / "tools" / f"{tool}.py"


def test_console_script_and_tool_path_say_the_same():
    argv = ["--checkpoint", "no/such/dir", "--data", "synthetic"]
    script = Path(sysconfig.get_path("scripts")) / "bebop-eval-acceptance"
    by_script = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=120)
    by_path = subprocess.run([sys.executable, str(ROOT / "tools" / "eval_acceptance.py"), *argv], capture_output=True,
                             text=True, timeout=120)
    assert by_script.returncode == by_path.returncode == 2
    assert by_script.stderr == by_path.stderr == (
        "error: checkpoint not found: no/such/dir (expected a save.dir with 'latest' or an iter_N directory)\n")
