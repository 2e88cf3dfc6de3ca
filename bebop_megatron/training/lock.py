"""One run per ``save.dir``: rank 0 holds ``save.dir/run.lock`` while the run lives.

The lock file says who holds it (host, pid, process start time, start date, Slurm job and
restart count, command line). A second run on the same directory is refused with one line
naming the holder. A lock is stale, and taken over with a notice, when its holder is gone:

- same host, and that pid is not alive (or is another process: a different start time);
- same Slurm job at an earlier restart count (a requeued job: Slurm requeues only after
  every process of the previous incarnation has ended).

A lock held on another host cannot be checked from here: the run is refused, and the message
says to delete the lock file if that run is known to be gone. The lock is released at exit
(also after an error, a preemption or Ctrl-C); after ``kill -9`` it stays, and is stale.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import sys

LOCK_FILE = "run.lock"


def _process_start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def this_run() -> dict:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "process_start": _process_start_time(pid),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "command": " ".join(sys.argv)[:300],
    }


def describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {holder.get('started')}"


def is_stale(holder: dict, me: dict) -> bool:
    """True when the holder is known to be gone (see the module docstring)."""
    if holder.get("slurm_job") and holder["slurm_job"] == me["slurm_job"]:
        if int(holder.get("slurm_restart") or 0) < me["slurm_restart"]:
            return True
    if holder.get("host") != me["host"] or not isinstance(holder.get("pid"), int):
        return False
    if not _pid_alive(holder["pid"]):
        return True
    started, recorded = _process_start_time(holder["pid"]), holder.get("process_start")
    return recorded is not None and started is not None and abs(started - recorded) > 1  # a reused pid


def _create(path: str, me: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # a full disk: no empty lock file left to refuse the next run
        try:
            os.remove(path)
        except OSError:
            pass
        raise
    return True


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else None
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None


def acquire(save_dir: str) -> str | None:
    """Take the lock (rank 0). Returns a notice when a stale lock was taken over, else None.
    Raises ``ValueError`` (one line) when another live run, or an unreadable lock, holds it."""
    os.makedirs(save_dir, exist_ok=True)
    return acquire_file(os.path.join(save_dir, LOCK_FILE), f"save.dir={save_dir}", "save.dir", "directory")


def acquire_file(path: str, name: str, flag: str, kind: str) -> str | None:
    """Take the lock file ``path`` for what the messages call ``name`` (e.g. ``--out F``; another
    ``flag`` is the way out, a ``kind`` is what it names), as :func:`acquire` does for a save.dir
    (``tools/generate_responses.py`` locks its ``--out`` this way)."""
    from bebop_megatron.config import ConfigError

    me = this_run()
    notice = None
    for _ in range(3):  # a concurrent run may create or take over the lock between our steps
        if _create(path, me):
            atexit.register(release, path, me)
            return notice
        holder = _read(path)
        if holder == {}:
            continue  # released meanwhile
        if holder and all(holder.get(k) == me[k] for k in ("host", "pid", "process_start")):
            return notice  # this process holds it already
        if holder is None:
            raise ConfigError(f"{name} is locked by {path}, which cannot be read; if no run uses this {kind}, "
                              "delete the lock file")
        if not is_stale(holder, me):
            raise ConfigError(
                f"{name} is in use by another run ({describe(holder)}; lock {path}): wait for it to end or use "
                f"another {flag}; if that run is gone, delete the lock file"
            )
        notice = f"{name}: taking over the lock of a run that is gone ({describe(holder)})"
        stale = f"{path}.stale.{me['pid']}"
        try:
            os.replace(path, stale)
        except FileNotFoundError:
            continue
        if _read(stale) != holder:  # another run took the lock over meanwhile: give it back
            try:
                os.link(stale, path)
            except FileExistsError:
                pass
        os.remove(stale)
    raise ConfigError(f"{name}: could not take the lock {path} (another run is starting?)")


def release(path: str, me: dict) -> None:
    """Delete the lock if it is still this run's."""
    if os.getpid() != me["pid"]:  # a forked child (e.g. an async checkpoint writer) inherits atexit
        return
    holder = _read(path)
    if holder and holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
        try:
            os.remove(path)
        except OSError:
            pass
