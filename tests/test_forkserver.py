"""The fork server (``tests/helpers/forkserver.py``) launches a script as a fresh interpreter does:
the same output, exit status, signals, argv, directory, environment, ``sys.path[0]``, buffering,
thread count, process group, atexit handlers and threads, checked against ``subprocess`` itself
running the same script; what it cannot fork (another program, an interpreter option, an
import-time variable that differs) goes to ``subprocess``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import forkserver

pytestmark = pytest.mark.skipif(os.environ.get("BEBOP_TEST_FORKSERVER") == "0",
                                reason="BEBOP_TEST_FORKSERVER=0: the fork server is off, every launch is fresh")

PROBE = r'''
import atexit, json, os, random, sys, threading, time

mode = sys.argv[1]
if mode == "report":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("PROBE_X"), "name": __name__,
                      "file": __file__, "path0": sys.path[0], "pgid": os.getpgid(0) == os.getpid(),
                      "random": random.random()}))
    print("to stderr", file=sys.stderr)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "message":
    sys.exit("a message")
elif mode == "raise":
    raise ValueError("boom")
elif mode == "interrupt":
    raise KeyboardInterrupt
elif mode == "sigterm":
    os.kill(os.getpid(), 15)
    time.sleep(10)
elif mode == "unflushed":  # a buffered line is lost at os._exit, an unbuffered one is not
    sys.stdout.write("line\n")
    os._exit(0)
elif mode == "atexit":
    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread ran"))).start()
elif mode == "threads":
    import torch
    print(torch.get_num_threads())
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return str(path)


def both(probe, *args, env=None, **kwargs):
    """(fresh interpreter, forked) results of ``python probe.py ARGS``."""
    cmd = [sys.executable, probe, *args]
    env = {**os.environ, **(env or {})}
    fresh = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, **kwargs)
    forked = forkserver.run(cmd, capture_output=True, text=True, timeout=120, env=env, **kwargs)
    return fresh, forked


@pytest.mark.parametrize("args", [["exit", "0"], ["exit", "3"], ["exit", "300"], ["message"], ["unflushed"],
                                  ["atexit"], ["sigterm"]])
def test_status_and_output_equal_a_fresh_interpreter(probe, args):
    fresh, forked = both(probe, *args)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_unbuffered_output_equals_a_fresh_interpreter(probe):
    fresh, forked = both(probe, "unflushed", env={"PYTHONUNBUFFERED": "1"})
    assert forked.stdout == fresh.stdout == "line\n"


@pytest.mark.parametrize("mode, status", [("raise", 1), ("interrupt", -signal.SIGINT)])
def test_an_uncaught_exception_prints_its_traceback(probe, mode, status):
    fresh, forked = both(probe, mode)
    assert forked.returncode == fresh.returncode == status
    last = fresh.stderr.strip().splitlines()[-1]
    assert "Traceback (most recent call last):" in forked.stderr and forked.stderr.strip().splitlines()[-1] == last


def test_argv_directory_environment_and_path(probe, tmp_path):
    fresh, forked = both(probe, "report", "a b", cwd=tmp_path, env={"PROBE_X": "y"})
    a, b = json.loads(fresh.stdout), json.loads(forked.stdout)
    assert a.pop("random") != b.pop("random")  # its own seed, as a fresh interpreter's
    assert a == b == {"argv": [probe, "report", "a b"], "cwd": str(tmp_path), "x": "y", "name": "__main__",
                      "file": probe, "path0": os.path.dirname(probe), "pgid": False}
    assert forked.stderr == fresh.stderr == "to stderr\n"


def test_threads_follow_omp_num_threads(probe):
    for threads in ("1", "2"):
        fresh, forked = both(probe, "threads", env={"OMP_NUM_THREADS": threads})
        assert forked.stdout == fresh.stdout == f"{threads}\n"


def test_process_group_signals_and_timeout(probe):
    first = forkserver.popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=0)
    second = forkserver.popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=first.pid)
    assert isinstance(first, forkserver.ForkedProcess)
    assert os.getpgid(first.pid) == os.getpgid(second.pid) == first.pid != os.getpgid(0)
    assert first.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        first.wait(timeout=0.2)
    os.killpg(first.pid, signal.SIGTERM)
    assert (first.wait(10), second.wait(10)) == (-signal.SIGTERM, -signal.SIGTERM)
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    assert time.monotonic() - start < 30


def test_module_and_code_launches(tmp_path):
    code = "import sys; print(sys.argv, sys.path[0] == '')"
    fresh = subprocess.run([sys.executable, "-c", code, "x"], capture_output=True, text=True)
    forked = forkserver.run([sys.executable, "-c", code, "x"], capture_output=True, text=True)
    assert forked.stdout == fresh.stdout == "['-c', 'x'] True\n"
    (tmp_path / "probe_module.py").write_text("import sys; print(__name__, sys.argv[1:])")
    args = [sys.executable, "-m", "probe_module", "y"]
    fresh = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True)
    forked = forkserver.run(args, cwd=tmp_path, capture_output=True, text=True)
    assert forked.stdout == fresh.stdout == "__main__ ['y']\n"


def test_what_it_cannot_fork_goes_to_subprocess():
    """Another program, an interpreter option, another value of a variable the preloaded modules
    read at import (here PYTHONHASHSEED): a fresh interpreter."""
    other_seed = "7" if os.environ.get("PYTHONHASHSEED") == "123" else "123"
    code = "print(hash('bebop'))"
    env = {**os.environ, "PYTHONHASHSEED": other_seed}
    procs = [forkserver.popen(["true"]), forkserver.popen([sys.executable, "-X", "dev", "-c", "pass"]),
             forkserver.popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL)]
    assert [type(p) for p in procs] == [subprocess.Popen] * 3
    assert [p.wait(60) for p in procs] == [0, 0, 0]
    fresh = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert forkserver.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout == fresh.stdout


def test_a_server_that_cannot_start_is_an_error_that_says_why(monkeypatch, tmp_path):
    """Its stderr in the error, its socket folder removed (here the "interpreter" exits at once)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no torch here' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(forkserver, "_server_state", {})
    monkeypatch.setattr(forkserver.sys, "executable", str(fake))
    monkeypatch.setattr(forkserver.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"(?s)did not start \(3\).*no torch here"):
        forkserver.popen([str(fake), "-c", "pass"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python"]
