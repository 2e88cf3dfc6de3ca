"""Run several invocations of the conversion tools in one Python process.

    python tests/helpers/cli_batch.py calls.json results.json
    torchrun --nproc_per_node 2 tests/helpers/cli_batch.py calls.json results.json  (or run_batch(nproc=2))

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
``main`` takes the call's argv. Under torchrun (or ``run_batch(..., nproc=2)``, which starts
the ranks as torchrun does, without its agent: :func:`launch_ranks`)
every rank makes every call, as each rank of a launched tool would, except a call with
``"alone": true``, which rank 0 makes by itself, as a single-process run in a process group of
its own (destroyed after it), and a call with ``"ranks": N``, which the first N ranks make as a
world of N ranks with a process group of their own (e.g. a 2-rank training run in a 4-rank
launch); the other ranks wait for it, then go on to the next call. The launch's process group
(torchrun's store) is initialised once: a call by all the ranks together may follow calls by
some of them only if no call before initialised it. Rank 0's results are returned.
From a test: :func:`run_batch`.
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
    with world_of(1):
        yield


@contextlib.contextmanager
def world_of(size: int, store_file: Path | None = None):
    """A torchrun rank's environment made that of rank ``RANK`` of a world of the launch's first
    ``size`` ranks, and the process group it initialised destroyed afterwards (as
    :func:`world_of_one`, which is ``size`` 1: rank 0 of a single process). ``size`` > 1: rank 0
    hosts the new world's store (as torchrun's agent hosts the launch's) and writes its port to
    ``store_file``, where the other ranks of the world read it; the store lives as long as the
    process. This rank's part of the launch's process group, if a previous call initialised one,
    is destroyed first: later calls that need all the launch's ranks together cannot follow."""
    import torch.distributed as dist

    from tests.helpers.launch import _free_port

    _destroy_process_group()
    rank = int(os.environ.get("RANK", "0")) if size > 1 else 0
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_USE_AGENT_STORE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))
    if size == 1:
        os.environ["MASTER_PORT"] = str(_free_port())
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    else:
        if rank == 0:  # a port of the OS's choosing, bound at once: none to race for
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            _stores.append(store)
            store_file.with_suffix(".tmp").write_text(str(store.port))
            os.replace(store_file.with_suffix(".tmp"), store_file)
        while not store_file.exists():
            time.sleep(0.05)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=store_file.read_text(),
                          TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        yield
    finally:
        _destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_stores: list = []  # the stores rank 0 hosts for worlds of some of the launch's ranks (world_of)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


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
    """``(calls file, results file)`` in ``workdir`` for a batch (``python cli_batch.py CALLS
    RESULTS``, or a launch of it); read back with :func:`read_results`."""
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
    launch of that many CPU ranks, :func:`launch_ranks`); one ``CompletedProcess``-like result
    per call (rank 0's)."""
    from tests.helpers import forkserver

    calls_file, results_file = write_calls(calls, workdir)
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", **extra})
    args = [__file__, str(calls_file), str(results_file)]
    if nproc == 1:
        proc = forkserver.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    else:
        proc = launch_ranks(args, nproc, env, timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_results(calls, results_file)


def launch_ranks(args: list[str], nproc: int, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """``python ARGS`` as ``nproc`` ranks, each in the environment torchrun gives its workers
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` /
    ``MASTER_PORT`` of a store that every rank is a client of, ``TORCHELASTIC_USE_AGENT_STORE``),
    without torchrun's agent, a process that imports torch (about 2 s of CPU a launch): this
    process hosts the store (on a port the OS picked), and stops every rank once one fails or
    ``timeout`` passes. The ranks' stdout and stderr, one rank after the other."""
    import tempfile

    import torch.distributed as dist

    from tests.helpers import forkserver

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        procs, outputs = [], []
        for rank in range(nproc):
            out, err = open(f"{tmp}/{rank}.out", "w+"), open(f"{tmp}/{rank}.err", "w+")
            outputs.append((out, err))
            procs.append(forkserver.popen([sys.executable, *args], cwd=REPO, stdout=out, stderr=err, env={
                **env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True"}))
        deadline, timed_out, killed = time.monotonic() + timeout, False, set()
        while any(p.poll() is None for p in procs):
            timed_out = time.monotonic() > deadline
            if timed_out or any(p.poll() not in (None, 0) for p in procs):
                for rank, p in enumerate(procs):
                    if p.poll() is None:
                        p.kill()
                        killed.add(rank)
                for p in procs:
                    p.wait()
                break
            time.sleep(0.1)
        text = []
        for out, err in outputs:
            out.seek(0), err.seek(0)
            text.append((out.read(), err.read()))
            out.close(), err.close()
    if timed_out:
        raise subprocess.TimeoutExpired(args, timeout, "".join(o for o, _ in text), "".join(e for _, e in text))
    codes = [p.returncode for p in procs]
    # the status of a rank that failed by itself, not of one stopped here because of it
    failed = [c for r, c in enumerate(codes) if c and r not in killed] or [c for c in codes if c]
    return subprocess.CompletedProcess(args, failed[0] if failed else 0, "".join(o for o, _ in text),
                                       "".join(f"--- rank {r} (exit status {c}{', stopped here' if r in killed else ''})\n{e}"
                                               for r, (c, (_, e)) in enumerate(zip(codes, text))))


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
    to ``results_path``; other ranks return once rank 0's ``alone`` and ``ranks`` calls are made."""
    tools: dict = {}
    results = []
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    done = None  # rank 0 marks each call made by some ranks only; the others wait for it before the next call
    for i, call in enumerate(calls):
        size = 1 if call.get("alone") else int(call.get("ranks", world))
        if done is not None and rank != 0:
            _wait(done)
        if size >= world:
            results.append(_make(call, tools))
            continue
        done = Path(f"{results_path}.done{i}")
        if rank >= size:
            results.append({"returncode": 0, "stdout": "",
                            "stderr": f"(made by the first {size} rank(s), not rank {rank})"})
            continue
        with world_of(size, Path(f"{results_path}.store{i}")):
            results.append(_make(call, tools))
        if rank == 0:
            done.write_text("done")
    if done is not None and rank != 0:
        _wait(done, preload=False)
    Path(results_path + (f".rank{rank}" if rank else "")).write_text(json.dumps(results))
    if _stores and rank == 0:  # the worlds' other ranks may still be leaving their process groups
        for other in range(1, world):
            while not Path(f"{results_path}.rank{other}").exists():
                time.sleep(0.05)


def _wait(done: Path, preload: bool = True) -> None:
    """Wait for rank 0 to mark a call done; meanwhile (``preload``: a call follows), on a core
    rank 0 leaves idle, import what the tools import first (torch, Megatron-Core, the model's
    modules)."""
    if preload and not done.exists():
        importlib.import_module("bebop_megatron.config")
        importlib.import_module("bebop_megatron.model")
    while not done.exists():
        time.sleep(0.05)


def main() -> None:
    sys.path.insert(0, str(REPO))
    make_calls(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])


if __name__ == "__main__":
    main()
