"""Ranks stop when their launcher is gone; a rank's helper processes stop with their rank.

torchrun's workers are its child processes. When torchrun itself dies without cleaning up
(``kill -9``, the OOM killer), they are re-parented (to PID 1 or a subreaper) and would go on
training and saving under nobody's control. :func:`watch_launcher` (called by
:func:`bebop_megatron.cli.run_cli` under torchrun) polls the parent pid in a daemon thread;
when it changes, the rank says so and sends itself SIGTERM: the trainer saves a checkpoint at
the next step and stops as on preemption, saying that the launcher is gone (:func:`gone`); any
other entry point ends at once. A rank still alive
``grace_s`` later (e.g. blocked in a collective with a rank that is already gone) is ended
with ``os._exit``. Stdlib only: the entry points call it before the heavy imports.
:func:`leave_report_to_rank0` keeps a failing rank alive until rank 0 has reported the error.

:func:`shield_helper` starts a rank's helper process (the manager that relays the async
checkpoint writer's results): srun, scancel and torchrun signal every process of the job, and
a helper killed by that SIGTERM would fail the rank's final save; it ignores the job's signals
and ends when its rank is gone instead.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

LAUNCHER_GONE_EXIT_CODE = 1
GRACE_S = 60.0
REPORT_GRACE_S = 10.0
_watched: int | None = None  # the launcher's pid, once watch_launcher runs


def watch_launcher(poll_s: float = 0.5, grace_s: float = GRACE_S) -> threading.Thread | None:
    """Start the watchdog thread under torchrun (``TORCHELASTIC_RUN_ID`` set); None elsewhere."""
    global _watched
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    _watched = os.getppid()
    thread = threading.Thread(target=_watch, args=(_watched, poll_s, grace_s), name="launcher-watchdog",
                              daemon=True)
    thread.start()
    return thread


def gone() -> int | None:
    """The pid of this rank's launcher when it is gone (the rank is no longer its child), else None."""
    return _watched if _watched is not None and os.getppid() != _watched else None


def _watch(launcher_pid: int, poll_s: float, grace_s: float) -> None:
    while os.getppid() == launcher_pid:
        time.sleep(poll_s)
    rank = os.environ.get("RANK", "?")
    try:  # the launcher may have held the other end of stderr
        # What happened, not an "error:" line: the trainer's last line says where it stopped.
        print(f"[rank {rank}] the launcher (pid {launcher_pid}) is gone: stopping this rank with SIGTERM (a "
              f"checkpoint at the next step if training, forced exit in {grace_s:.0f}s)", file=sys.stderr, flush=True)
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(LAUNCHER_GONE_EXIT_CODE)


def leave_report_to_rank0(grace_s: float = REPORT_GRACE_S) -> None:
    """Before a rank other than 0 exits with an error that rank 0 reports (one every rank raises
    alike, e.g. a config error): under torchrun, wait up to ``grace_s`` for rank 0 to print it.

    torchrun stops every other rank (SIGTERM) as soon as one exits with an error, and srun
    (``--kill-on-bad-exit``) every other node: a rank that got there first would cut rank 0 off
    before its ``error:`` line, leaving a job's output without it. Rank 0's exit ends the wait
    (torchrun's SIGTERM gets its default action back here). Elsewhere it returns at once."""
    if _watched is None:
        return
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(grace_s)


HELPER_IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def shield_helper(rank_pid: int, poll_s: float = 1.0) -> None:
    """Initializer of a rank's helper process: ignore :data:`HELPER_IGNORED_SIGNALS` (the rank
    handles them, and needs the helper until its checkpoint is written), exit once ``rank_pid``
    is no longer the parent (the rank exited or was killed)."""
    for sig in HELPER_IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == rank_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="rank-watchdog", daemon=True).start()
