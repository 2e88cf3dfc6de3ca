"""Start the tests' Python processes by forking one that has already imported torch and Megatron-Core.

Every launch of a tool, of ``examples/pretrain_mtp.py`` or of a ``tests/helpers`` case in a fresh
interpreter imports torch, Megatron-Core and this package again: about 6 s of CPU on a slow 2-core
machine, more than most tiny runs take. A test worker (pytest-xdist's, or pytest itself) starts
a *fork server* the first time it launches something (``tests/helpers/forkserver_process.py``):
a process that imports those modules (its ``PRELOAD``) and nothing else, runs no torch operation
(so no OpenMP or other thread exists when it forks), and forks a copy of itself for each launch.
The copy takes the launch's standard streams, working directory, environment, process group and
``sys.argv`` and runs the script as ``python SCRIPT ARGS`` would (``runpy``, as ``__main__``;
``-c CODE`` and ``-m MODULE`` too): its exit status, its signals and its output are a
subprocess's (``tests/test_forkserver.py`` compares them).

:func:`popen` and :func:`run` take ``subprocess.Popen``'s and ``subprocess.run``'s arguments and
use the server for ``[sys.executable, ...]`` commands; anything else (another program, an
interpreter option: :func:`_forkable`; an import-time variable that differs, below) goes to
``subprocess`` unchanged, as does everything when ``BEBOP_TEST_FORKSERVER=0``.

What a forked launch does not repeat: the preloaded modules' import-time work. They saw the
server's environment, the test worker's: a launch whose environment differs from it in a variable
of :data:`IMPORT_TIME_ENV` (``TRITON_INTERPRET=1``, another ``PYTHONHASHSEED``) starts a fresh
interpreter. What a forked launch does redo as a fresh interpreter would: ``OMP_NUM_THREADS``
(``torch.set_num_threads``), ``PYTHONUNBUFFERED`` (unbuffered stdout and stderr), the seeds of
``random`` and NumPy's global generator.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from tests.helpers.forkserver_process import _HEADER

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Environment variables read while the interpreter starts or the preloaded modules import: a launch
# whose values of these differ from the server's starts a fresh interpreter (TRITON_INTERPRET:
# Triton's own ``triton.language`` helpers are decorated, interpreted or compiled, at import).
IMPORT_TIME_ENV = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE",
                   "TORCH_LOGS", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")


class ForkedProcess:
    """A launch made by the fork server, with ``subprocess.Popen``'s ``pid``, ``returncode``,
    ``poll``, ``wait``, ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(self, args, conn: socket.socket):
        self.args, self._conn, self._buffer = args, conn, b""
        self.returncode = None
        self.pid = self._message(None)["pid"]

    def _message(self, timeout: float | None) -> dict | None:
        """The server's next message; ``None`` when ``timeout`` passes first (0: do not wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            # None: block; 0: a non-blocking read
            self._conn.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            try:
                chunk = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise RuntimeError(f"the fork server's handler of {self.args} went away")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self):
        if self.returncode is None:
            message = self._message(0.0)
            if message is not None:
                self._done(message["returncode"])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            message = self._message(timeout)
            if message is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._done(message["returncode"])
        return self.returncode

    def _done(self, code: int) -> None:
        self.returncode = code
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.returncode is None:
            self.kill()
            self.wait()


_server_state: dict = {}  # this process's server: {"pid", "proc", "path", "log", "import_env"}


def _import_env(env) -> tuple:
    return tuple(env.get(name) for name in IMPORT_TIME_ENV)


def _server() -> dict:
    """This process's fork server, started on first use with this process's environment (its
    own stderr, the imports' warnings included, goes to a file that :func:`server_log` reads)."""
    server = _server_state
    if server.get("pid") == os.getpid():
        if server["proc"].poll() is not None:
            raise RuntimeError(f"the fork server exited ({server['proc'].returncode}):\n{server_log(server)}")
        return server
    directory = tempfile.mkdtemp(prefix="bebop_forkserver_")
    path, log = os.path.join(directory, "socket"), os.path.join(directory, "stderr")
    # OMP_NUM_THREADS=1: else torch's import starts OpenMP's thread; each launch sets its own count
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.forkserver_process", path], cwd=REPO, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True)
    server.clear()
    server.update(pid=os.getpid(), proc=proc, path=path, log=log, import_env=_import_env(env))
    if proc.stdout.readline().strip() != "ready":
        proc.wait()
        why = server_log(server)
        shutil.rmtree(directory, ignore_errors=True)
        server.clear()
        raise RuntimeError(f"the fork server did not start ({proc.returncode}); BEBOP_TEST_FORKSERVER=0 "
                           f"launches fresh interpreters instead:\n{why}")

    def stop(proc=proc, directory=directory):
        proc.kill()
        proc.wait()
        shutil.rmtree(directory, ignore_errors=True)

    atexit.register(stop)
    return server


def server_log(server: dict) -> str:
    """The end of a fork server's stderr."""
    try:
        with open(server["log"]) as f:
            return f.read()[-4000:]
    except OSError:
        return ""


def _forkable(args, kwargs: dict) -> bool:
    if os.environ.get("BEBOP_TEST_FORKSERVER", "1") == "0" or sys.platform != "linux":
        return False
    if not isinstance(args, (list, tuple)) or len(args) < 2 or args[0] != sys.executable:
        return False
    if args[1].startswith("-") and args[1] not in ("-c", "-m"):
        return False
    return not set(kwargs) - {"cwd", "env", "stdin", "stdout", "stderr", "process_group", "start_new_session"}


def _fd(stream, default: int, opened: list) -> int:
    """A file descriptor for one standard stream of a launch (None: this process's own)."""
    if stream is None:
        return default
    if stream == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd
    if isinstance(stream, int):
        return stream
    return stream.fileno()


def popen(args, **kwargs):
    """``subprocess.Popen(args, **kwargs)``, made by the fork server where :func:`_forkable`
    (``stdin``, ``stdout``, ``stderr``: None, DEVNULL, a file or a descriptor; ``stderr=STDOUT``)."""
    if not _forkable(args, kwargs) or kwargs.get("stdin") == subprocess.PIPE \
            or subprocess.PIPE in (kwargs.get("stdout"), kwargs.get("stderr")):
        return subprocess.Popen(args, **kwargs)
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    # what the preloaded modules saw (or would see: this environment, a server not yet started) differs:
    # a fresh interpreter, without starting a server for nothing
    running = _server_state.get("pid") == os.getpid()
    if _import_env(env) != (_server_state["import_env"] if running else _import_env(os.environ)):
        return subprocess.Popen(args, **kwargs)
    server = _server()
    opened: list[int] = []
    try:
        out = _fd(kwargs.get("stdout"), 1, opened)
        err = out if kwargs.get("stderr") == subprocess.STDOUT else _fd(kwargs.get("stderr"), 2, opened)
        fds = [_fd(kwargs.get("stdin"), 0, opened), out, err]
        request = {"argv": [str(a) for a in args[1:]], "cwd": os.fspath(kwargs.get("cwd") or os.getcwd()),
                   "env": env, "pgid": kwargs.get("process_group"),
                   "new_session": bool(kwargs.get("start_new_session"))}
        body = json.dumps(request).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(server["path"])
        data = _HEADER.pack(len(body)) + body
        sent = socket.send_fds(conn, [data], fds)
        conn.sendall(data[sent:])
        return ForkedProcess(list(args), conn)
    finally:
        for fd in opened:
            os.close(fd)


_subprocess_run = subprocess.run  # a test may replace subprocess.run by run: the fallback stays the real one


def run(args, *, capture_output: bool = False, text: bool = False, timeout: float | None = None,
        check: bool = False, input: str | bytes | None = None, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run``, through :func:`popen` (``capture_output`` or ``stdout``/``stderr=PIPE``:
    through temporary files)."""
    if input is not None or not _forkable(args, kwargs):
        return _subprocess_run(args, capture_output=capture_output, text=text, timeout=timeout, check=check,
                               input=input, **kwargs)
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        piped = {name: kwargs.get(name) == subprocess.PIPE for name in ("stdout", "stderr")}
        kwargs.update({name: stream for (name, pipe), stream in zip(piped.items(), (out, err)) if pipe})
        proc = popen(args, **kwargs)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        captured = []
        for pipe, stream in zip(piped.values(), (out, err)):
            stream.seek(0)
            data = stream.read() if pipe else None
            captured.append(data.decode() if text and data is not None else data)
    result = subprocess.CompletedProcess(args, proc.returncode, *captured)
    if check:
        result.check_returncode()
    return result
