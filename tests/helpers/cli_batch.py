"""Run several invocations of the conversion tools in one Python process.

    python tests/helpers/cli_batch.py calls.json results.json
    torchrun --nproc_per_node 2 tests/helpers/cli_batch.py calls.json results.json

A tiny conversion takes well under a second; importing torch, Megatron-Core and transformers
takes several. Tests that need many invocations therefore run them here, one after the other,
each exactly as the tool's ``__main__`` does (``bebop_megatron.cli.run_cli(main(argv))``),
with its stdout, stderr and exit status recorded separately.

``calls.json``: ``[{"tool": "convert_to_hf", "argv": [...]}, ...]`` (a ``tool`` ending in ``.py``
is a script's path in the repository, e.g. a ``tests/helpers`` case with ``main(argv)``); the pseudo-tool
``record_mtp`` (argv ``SRC DST KEY=VALUE...``) copies a model checkpoint and sets ``mtp``
fields of its ``bebop_model.yaml`` (e.g. ``next_step_input=pre_norm``: heads trained that way);
the pseudo-tool ``copytree`` (argv ``SRC DST``) copies a directory;
``results.json``: ``[{"returncode": int, "stdout": str, "stderr": str}, ...]`` in the same order.
A tool is looked up in ``tools/``, then ``examples/`` (``pretrain_mtp``); every script's
``main`` takes the call's argv. Under torchrun (``run_batch(..., nproc=2)``)
every rank makes every call, as each rank of a launched tool would, except a call with
``"alone": true``, which rank 0 makes by itself, as a single-process run in a process group of
its own (destroyed after it), while the other ranks go on to the next call; rank 0's results are
returned. From a test: :func:`run_batch`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str):
    """``tools/<name>.py`` (else ``examples/<name>.py``), or a script given by its path in the
    repository (``tests/helpers/x.py``)."""
    if name.endswith(".py"):
        path = REPO / name
    else:
        path = REPO / "tools" / f"{name}.py"
        if not path.exists():
            path = REPO / "examples" / f"{name}.py"
    name = Path(name).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call(tool, argv: list[str]) -> dict:
    from bebop_megatron.cli import run_cli

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_cli(lambda: tool.main(argv))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except Exception as exc:  # an unexpected traceback: the test shows it
            import traceback

            traceback.print_exc(file=err)
            code = f"uncaught {type(exc).__name__}"
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


@contextlib.contextmanager
def world_of_one():
    """A torchrun rank's environment made that of a single process (its own store and port),
    and the process group it initialised destroyed afterwards. This rank's part of the launch's
    process group, if a previous call initialised one, is destroyed first: later calls that need
    the ranks together cannot follow."""
    import torch.distributed as dist

    from tests.helpers.launch import _free_port

    if dist.is_initialized():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(_free_port()))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if dist.is_initialized():
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def record_mtp(argv: list[str]) -> dict:
    import shutil

    from omegaconf import OmegaConf

    src, dst, *fields = [a for a in argv if a != "--no-progress"]
    shutil.copytree(src, dst)
    conf = OmegaConf.load(Path(dst) / "bebop_model.yaml")
    for field in fields:
        key, value = field.split("=", 1)
        OmegaConf.update(conf, f"mtp.{key}", value)
    OmegaConf.save(conf, Path(dst) / "bebop_model.yaml")
    return {"returncode": 0, "stdout": "", "stderr": ""}


def write_calls(calls: list[dict], workdir: Path) -> tuple[Path, Path]:
    """``(calls file, results file)`` in ``workdir`` for a batch run by another launch
    (e.g. tests/helpers/convert_logits_case.py ``--calls``); read back with :func:`read_results`."""
    workdir.mkdir(parents=True, exist_ok=True)
    calls_file, results_file = workdir / "calls.json", workdir / "results.json"
    calls_file.write_text(json.dumps(calls))
    return calls_file, results_file


def read_results(calls: list[dict], results_file: Path) -> list[subprocess.CompletedProcess]:
    results = json.loads(results_file.read_text())
    return [subprocess.CompletedProcess(c["argv"], r["returncode"], r["stdout"], r["stderr"])
            for c, r in zip(calls, results)]


def run_batch(calls: list[dict], workdir: Path, timeout: int = 600,
              env: dict | None = None, nproc: int = 1) -> list[subprocess.CompletedProcess]:
    """Run ``calls`` in one subprocess (``env``: variables to set in it; ``nproc`` > 1: one
    torchrun launch of that many CPU ranks); one ``CompletedProcess``-like result per call
    (rank 0's)."""
    calls_file, results_file = write_calls(calls, workdir)
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", **extra})
    from tests.helpers.launch import _free_port

    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                      "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    proc = subprocess.run([sys.executable, *launcher, __file__, str(calls_file), str(results_file)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_results(calls, results_file)


def _make(call: dict, tools: dict) -> dict:
    if call["tool"] == "record_mtp":
        return record_mtp(call["argv"])
    if call["tool"] == "copytree":
        import shutil

        shutil.copytree(*call["argv"])
        return {"returncode": 0, "stdout": "", "stderr": ""}
    if call["tool"] not in tools:
        tools[call["tool"]] = _tool(call["tool"])
    return _call(tools[call["tool"]], call["argv"])


def make_calls(calls: list[dict], results_path: str) -> None:
    """Make ``calls`` in this process (every rank, under torchrun) and write rank 0's results
    to ``results_path``; other ranks return once rank 0's ``alone`` calls are made."""
    tools: dict = {}
    results = []
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    done_alone = None  # rank 0 marks each call it made alone; the others wait for it before the next call
    for i, call in enumerate(calls):
        if call.get("alone") and world > 1:
            done_alone = Path(f"{results_path}.alone{i}")
            if rank != 0:
                results.append({"returncode": 0, "stdout": "", "stderr": f"(made by rank 0 alone, not rank {rank})"})
                continue
            with world_of_one():
                results.append(_make(call, tools))
            done_alone.write_text("done")
            continue
        if done_alone is not None and rank != 0:
            while not done_alone.exists():
                time.sleep(0.05)
        results.append(_make(call, tools))
    if done_alone is not None and rank != 0:
        while not done_alone.exists():
            time.sleep(0.05)
    Path(results_path + (f".rank{rank}" if rank else "")).write_text(json.dumps(results))


def main() -> None:
    sys.path.insert(0, str(REPO))
    make_calls(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])


if __name__ == "__main__":
    main()
