"""The tools refuse values that make no sense, in one line, before any work (issue 36, item 11 and
its tracebacks / unclear lines), all in this process (parse_args / main):

- ``--temperatures inf`` (eval_acceptance) and ``speculative_generate --temperature inf`` printed
  perfect acceptance: the range is training's (0.001-1000, ``config.loader.TEMPERATURE_RANGE``);
- ``eval_acceptance --sim-positions -1`` ran another budget; ``convert_from_hf --mtp-num-steps 0``
  meant 3; ``--max-tensor-parallel 0`` / ``--make-vocab-size-divisible-by 0`` were a
  ZeroDivisionError and ``--max-tensor-parallel -8`` named model.padded_vocab_size;
  ``convert_to_hf --tolerance -1`` / ``nan`` wrote the export and then blamed it;
- ``speculative_generate --json`` into a missing directory failed after all the decoding;
  ``speculative_generate --limit 0`` said "no prompt in the file" (issue 48 item 21);
  ``eval_acceptance --out-dir`` an existing file was a FileExistsError at the end;
- the JSON the tools write holds ``null``, never bare ``NaN`` (``cli.write_json``).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def usage_error(capsys, name: str, argv: list[str]) -> str:
    """The argparse error line of ``name``'s parse_args (exit status 2)."""
    with pytest.raises(SystemExit) as exit_:
        load_tool(name).parse_args(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in lines[-1], lines
    return lines[-1].split(": error: ", 1)[1]


def cli_error(capsys, name: str, argv: list[str]) -> str:
    """The one ``error:`` line of ``name``'s main under run_cli (exit status 2)."""
    from bebop_megatron.cli import run_cli

    tool = load_tool(name)
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: tool.main(argv))
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_the_temperature_range_is_trainings():
    from bebop_megatron.config.loader import TEMPERATURE_RANGE

    assert load_tool("eval_acceptance").TEMPERATURES == TEMPERATURE_RANGE
    assert load_tool("speculative_generate").TEMPERATURES == TEMPERATURE_RANGE


@pytest.mark.parametrize("value", ["inf", "nan", "0.0005", "2000"])
def test_temperatures_outside_trainings_range_are_refused(capsys, value):
    eval_args = ["--checkpoint", "c", "--data", "synthetic", "--temperatures", "1.0", value]
    assert usage_error(capsys, "eval_acceptance", eval_args) == (
        f"--temperatures must all be in [0.001, 1000], got [1.0, {float(value)}]")
    spec_args = ["--checkpoint", "c", "--prompts", "p", "--temperature", value]
    assert usage_error(capsys, "speculative_generate", spec_args) == (
        f"--temperature must be in [0.001, 1000], got {float(value)}")
    for ok in ("0.001", "1000"):
        assert load_tool("speculative_generate").parse_args([*spec_args[:-1], ok]).temperature == float(ok)


def test_negative_counts_are_refused(capsys):
    assert usage_error(capsys, "eval_acceptance", ["--checkpoint", "c", "--data", "synthetic", "--sim-positions",
                                                   "-1"]) == "--sim-positions must be >= 0, got -1"
    assert load_tool("eval_acceptance").parse_args(["--checkpoint", "c", "--data", "synthetic", "--sim-positions",
                                                    "0"]).sim_positions == 0  # 0: no simulated chains
    imp = ["--hf-dir", "h", "--out", "o"]
    for flag, value in (("--mtp-num-steps", "0"), ("--max-tensor-parallel", "0"), ("--max-tensor-parallel", "-8"),
                        ("--make-vocab-size-divisible-by", "0")):
        assert usage_error(capsys, "convert_from_hf", [*imp, flag, value]) == f"{flag} must be >= 1, got {value}"
    spec = ["--checkpoint", "c", "--prompts", "p"]
    for flag, value in (("--limit", "0"), ("--limit", "-2"), ("--gamma", "0"), ("--max-new-tokens", "0"),
                        ("--batch-size", "0")):
        # (issue 48 item 21) --limit 0 read no prompt and said "no prompt in the file"
        assert usage_error(capsys, "speculative_generate", [*spec, flag, value]) == f"{flag} must be >= 1, got {value}"
    assert load_tool("speculative_generate").parse_args([*spec, "--limit", "1"]).limit == 1
    exp = ["--checkpoint", "c", "--format", "mimo", "--target", "vllm", "--out", "o"]
    for value in ("-1", "0", "nan", "inf"):
        assert usage_error(capsys, "convert_to_hf", [*exp, "--tolerance", value]) == (
            f"--tolerance must be a positive number, got {float(value)}")


def test_outputs_that_cannot_be_written_are_refused_before_the_work(capsys, tmp_path):
    ckpt = tmp_path / "iter_0000001"  # what the tools' path checks accept; never loaded here
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text("{}")
    missing = tmp_path / "nope" / "out.json"
    line = cli_error(capsys, "speculative_generate", ["--checkpoint", str(ckpt), "--prompts", str(tmp_path / "p"),
                                                      "--json", str(missing)])
    assert line == f"error: --json {missing}: the directory {missing.parent} does not exist; create it first"
    afile = tmp_path / "report.txt"
    afile.write_text("mine\n")
    line = cli_error(capsys, "eval_acceptance", ["--checkpoint", str(ckpt), "--data", "synthetic", "--out-dir",
                                                 str(afile)])
    assert line == f"error: --out-dir {afile} exists and is not a directory"
    line = cli_error(capsys, "eval_acceptance", ["--checkpoint", str(ckpt), "--data", "synthetic", "--out-dir",
                                                 str(afile / "sub")])
    assert line == f"error: --out-dir {afile / 'sub'}: {afile} exists and is not a directory"
    assert afile.read_text() == "mine\n"


def test_json_holds_null_not_nan(tmp_path):
    from bebop_megatron.cli import write_json

    path = tmp_path / "out.json"
    write_json(str(path), {"rate": math.nan, "ci": (1.0, math.inf), "nested": [{"x": -math.inf, "n": 3}], "s": "nan"})

    def no_constants(name):
        raise AssertionError(f"bare {name} in the JSON")

    assert json.loads(path.read_text(), parse_constant=no_constants) == {
        "rate": None, "ci": [1.0, None], "nested": [{"x": None, "n": 3}], "s": "nan"}


def test_eval_acceptance_context_parallel_flags(capsys):
    """``--context-parallel`` > 1 shards each row's forward: no decoding of whole sequences
    (``--sample``) and no timed forwards (measured costs); given costs or --no-speedup."""
    base = ["--checkpoint", "c", "--data", "synthetic", "--context-parallel", "2"]
    assert usage_error(capsys, "eval_acceptance", [*base, "--sample", "--no-speedup"]) == (
        "--sample decodes whole sequences: use --context-parallel 1")
    assert usage_error(capsys, "eval_acceptance", base) == (
        "--context-parallel > 1 measures no costs (the timed forwards run whole sequences): give --cost-ratio or "
        "--cost-target-ms/--cost-draft-ms, or pass --no-speedup")
    assert usage_error(capsys, "eval_acceptance", [*base[:-1], "0"]) == "--context-parallel must be >= 1"
    for costs in (["--no-speedup"], ["--cost-ratio", "0.1"], ["--cost-target-ms", "10", "--cost-draft-ms", "1"]):
        assert load_tool("eval_acceptance").parse_args([*base, *costs]).context_parallel == 2


def test_data_temperature_is_refused_for_the_synthetic_language(capsys):
    """(issue 48 item 19) Its held-out samples come from the language, not from the backbone: the
    label approximate and the Eq. 12 speed-up must stay; --sample is the way to exact text."""
    line = usage_error(capsys, "eval_acceptance", ["--checkpoint", "c", "--data", "synthetic", "--data-temperature",
                                                   "1.0"])
    assert line.startswith("--data-temperature: the synthetic language's held-out samples come from the language")
    assert line.endswith("pass --sample for text sampled from it")
