"""The fork server's own process (``tests/helpers/forkserver.py`` starts it and is its client).

    python -m tests.helpers.forkserver_process SOCKET     (prints "ready" once it can fork)

It imports :data:`PRELOAD` and nothing else, runs no torch operation (so no OpenMP or other
thread exists when it forks), then forks a handler per connection on the Unix socket; the
handler forks the launch, which becomes the launched ``python ARGS`` (:func:`_child`), and
reports its pid and exit status.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import signal
import socket
import struct
import sys
import threading

# What the server imports before it forks: what the launched tools and cases import first, in their
# order (bebop_megatron.config before Megatron-Core: bebop_megatron/platform/lazy_imports.py).
PRELOAD = (
    "torch", "torch.distributed", "numpy", "numpy.random", "numpy.fft", "omegaconf", "psutil", "safetensors.torch",
    "bebop_megatron.config", "megatron.core", "megatron.core.parallel_state", "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader",
    "megatron.core.models.hybrid.hybrid_block", "megatron.core.models.mimo",
    "bebop_megatron.cli", "bebop_megatron.model", "bebop_megatron.training", "bebop_megatron.losses.fused",
    "bebop_megatron.metrics", "bebop_megatron.speculative",
    "torch._dynamo",  # imported at the first training step (about 1 s of CPU)
)

_HEADER = struct.Struct("!I")  # the length of a request's JSON, before it


def serve(path: str) -> None:
    """Import :data:`PRELOAD`, then fork a handler per connection on the Unix socket ``path``."""
    _die_with_parent()
    for name in PRELOAD:
        importlib.import_module(name)
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:  # a forked copy of a thread pool's locks can hang: refuse rather than risk it
        raise SystemExit(f"forkserver: {len(threads)} threads after the imports, cannot fork safely")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the handlers are reaped by the kernel
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _handle(conn)
            finally:
                os._exit(0)
        conn.close()


def _die_with_parent() -> None:
    """SIGTERM this process when the test worker that started it exits (Linux ``PR_SET_PDEATHSIG``;
    forked children do not inherit it)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _handle(conn: socket.socket) -> None:
    """Receive a launch (a JSON request and three file descriptors), fork the process that runs it,
    send its pid, wait for it and send its exit status (negative: the signal that ended it)."""
    length, fds = None, []
    data = b""
    while length is None or len(data) < _HEADER.size + length:
        chunk, got, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        if not chunk:
            return
        data += chunk
        fds += got
        if length is None and len(data) >= _HEADER.size:
            length = _HEADER.unpack_from(data)[0]
    request = json.loads(data[_HEADER.size:])
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.close(ready_r)
        _child(request, fds, ready_w)  # never returns
    os.close(ready_w)
    for fd in fds:
        os.close(fd)
    os.read(ready_r, 1)  # its process group exists (or it failed) before its pid is known: another may join it
    os.close(ready_r)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _child(request: dict, fds: list[int], ready: int) -> None:
    """Become the launched process: its streams, group, directory, environment and argv; run it;
    exit as the interpreter would."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        if request["pgid"] is not None:
            os.setpgid(0, request["pgid"])
        if request["new_session"]:
            os.setsid()
        os.write(ready, b"1")
        os.close(ready)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_streams(bool(os.environ.get("PYTHONUNBUFFERED")))
        _fresh_state()
        code = _run(request["argv"])
    except BaseException:  # noqa: BLE001 - setting up failed: say why, as a crashed interpreter would
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _fresh_streams(unbuffered: bool) -> None:
    def writer(fd: int, errors: str, line: bool):
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                                line_buffering=line or os.isatty(fd), write_through=unbuffered)

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding="utf-8")
    sys.stdout = sys.__stdout__ = writer(1, "strict", False)
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace", True)


def _fresh_state() -> None:
    """What a fresh interpreter does differently from a copy of the server: its own seeds, and
    torch's thread count from ``OMP_NUM_THREADS`` (read once, when OpenMP loaded in the server)."""
    import random

    import numpy
    import torch

    random.seed()
    numpy.random.seed()
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads and threads.isdigit() else len(os.sched_getaffinity(0)))


def _run(argv: list[str]) -> int:
    """Run ``python ARGV`` in this process; its exit status."""
    import runpy

    try:
        try:
            if argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                sys.path[0] = ""
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            elif argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = _exit_code(exit_.code)
        except KeyboardInterrupt:
            import traceback

            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:  # noqa: BLE001 - an uncaught exception, as the interpreter reports it
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # noqa: SLF001 - the interpreter waits for non-daemon threads
        atexit._run_exitfuncs()  # noqa: SLF001
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    if code < 0:  # ended by a signal, as the interpreter re-raises SIGINT
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1])
