"""The entry point: user errors are one line and a non-zero exit, without a traceback."""

from __future__ import annotations

import pytest

from tests.helpers.cli_batch import run_batch
from tests.helpers.launch import REPO

CASES = {
    "unknown key": (["train.stepz=3"], "did you mean 'train.steps'"),
    "world size": ([], "parallel.tensor"),  # embedded default is TP=2, one process
    "fp8 on cpu": (["parallel.tensor=1", "precision=fp8"], "precision=fp8"),
    "EP without MoE": (["parallel.tensor=1", "parallel.expert=2"], "parallel.expert"),
    "TP not dividing heads": (["parallel.tensor=3"], "parallel.tensor"),
    "missing config file": (["--config", "nope.yaml"], "nope.yaml"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case and ``--help``, run in one process as the script's ``__main__`` runs it
    (``tests/helpers/cli_batch.py``): a process per case would import torch and Megatron again."""
    calls = [{"tool": "examples/pretrain_mtp.py", "argv": args} for args, _ in CASES.values()]
    calls.append({"tool": "examples/pretrain_mtp.py", "argv": ["--help"]})
    results = run_batch(calls, tmp_path_factory.mktemp("cli"))
    return dict(zip([*CASES, "--help"], results))


@pytest.mark.parametrize("case", list(CASES))
def test_user_error_is_one_line(runs, case):
    proc, expected = runs[case], CASES[case][1]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]


def test_help_lists_overrides(runs):
    proc = runs["--help"]
    assert proc.returncode == 0 and "key=value" in proc.stdout


@pytest.mark.parametrize("path", sorted((REPO / "examples" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_validate(path):
    from bebop_megatron.config import load_config, parallel_sizes

    cfg = load_config(str(path))
    parallel_sizes(cfg, world_size=2)  # each example is written for 2 ranks


def _run_cli_as(rank: int, error: BaseException, monkeypatch, capsys) -> tuple[int, str]:
    from bebop_megatron.cli import run_cli

    monkeypatch.setenv("RANK", str(rank))

    def main():
        raise error

    with pytest.raises(SystemExit) as exc:
        run_cli(main)
    return exc.value.code, capsys.readouterr().err


def test_an_error_raised_on_another_rank_is_printed_by_that_rank(monkeypatch, capsys):
    from bebop_megatron.config import ConfigError

    # an error only this rank may have raised (e.g. loading its shard): printed with its rank
    assert _run_cli_as(3, ValueError("cannot load checkpoint c: shard 3"), monkeypatch, capsys) == (
        2, "error: [rank 3] cannot load checkpoint c: shard 3\n")
    assert _run_cli_as(0, ValueError("boom"), monkeypatch, capsys) == (2, "error: boom\n")
    # one every rank raises alike (config checks, agreed decisions): rank 0 alone prints it
    assert _run_cli_as(1, ConfigError("train.steps=0 must be >= 1"), monkeypatch, capsys) == (2, "")
    assert _run_cli_as(0, ConfigError("train.steps=0 must be >= 1"), monkeypatch, capsys) == (
        2, "error: train.steps=0 must be >= 1\n")
