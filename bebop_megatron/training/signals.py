"""Preemption and Ctrl-C: SIGTERM or SIGUSR1 ask for a checkpoint and an exit the launcher
requeues; SIGINT (Ctrl-C) for a checkpoint and exit status 130.

Slurm sends SIGUSR1 before the time limit (``#SBATCH --signal``) and SIGTERM on preemption;
``slurm/train_tv.sbatch`` forwards them to every rank through srun and torchrun. The handler
only records the signal; the trainer agrees on it across ranks at the next step boundary
(ranks may receive it at different steps), finishes that step, saves a complete checkpoint
and exits with :data:`REQUEUE_EXIT_CODE`.

Ctrl-C (SIGINT) is handled the same way, with :data:`INTERRUPT_EXIT_CODE` (not requeued): in a
single process the terminal sends it to the trainer; under torchrun to torchrun alone (its
ranks run in sessions of their own), which forwards it to every rank and gives them its
``--shutdown-timeout`` (30 s by default) to exit before it kills them (torchrun itself then
exits with 1 and its own ``SignalException`` report). A second SIGINT that reaches the trainer
stops it at once (``KeyboardInterrupt``), without that checkpoint (under torchrun a second Ctrl-C
reaches torchrun alone).
"""

from __future__ import annotations

import os
import signal
import threading

REQUEUE_EXIT_CODE = 75
"""Exit status after a preemption checkpoint (``EX_TEMPFAIL``: "try again later")."""

INTERRUPT_EXIT_CODE = 130
"""Exit status after the checkpoint of a Ctrl-C (SIGINT): 128 + 2, a shell's status of an
interrupted command. Not :data:`REQUEUE_EXIT_CODE`: the user stopped the run, no launcher
should start it again."""

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised after the stop checkpoint is written; exits with ``code`` (:data:`REQUEUE_EXIT_CODE`
    after a preemption signal, :data:`INTERRUPT_EXIT_CODE` after Ctrl-C)."""

    def __init__(self, message: str, code: int = REQUEUE_EXIT_CODE):
        super().__init__(code)
        self.message = message


def stop_message(received: str | None, checkpoint: str | None, step: int, launcher_gone: int | None = None,
                 interrupted: bool = False) -> str:
    """The trainer's last line after a stop signal: what happened, where it stopped, its exit status.

    ``launcher_gone``: the pid of a launcher found gone (:func:`bebop_megatron.launcher.gone`);
    its watchdog sent the SIGTERM, and no launcher is left to requeue the job. ``interrupted``:
    the ranks stop for a Ctrl-C (SIGINT, on this rank or another) and no preemption signal."""
    where = f"checkpoint {checkpoint or '(none: save.dir is null)'} at step {step}"
    if interrupted and launcher_gone is None:
        resume = " (train.resume=auto continues from it)" if checkpoint else ""
        return f"SIGINT (Ctrl-C): {where}; exiting with {INTERRUPT_EXIT_CODE}{resume}"
    if launcher_gone is not None:
        why = f"the launcher (pid {launcher_gone}) is gone" + (f" ({received})" if received else "")
        return f"{why}: {where}; stopped with exit status {REQUEUE_EXIT_CODE} (train.resume=auto continues from it)"
    return f"{received or 'preemption signal'}: {where}; exiting with {REQUEUE_EXIT_CODE} so that the launcher " \
        "requeues the job"


class PreemptionHandler:
    """Records SIGTERM / SIGUSR1 and SIGINT; ``received`` is the name of the first one, else None;
    ``preempted``: the name of the first SIGTERM or SIGUSR1, else None; ``interrupted``: a SIGINT came.

    ``interrupt_notice``: written to stderr at the first SIGINT (empty: nothing). A second SIGINT
    raises ``KeyboardInterrupt`` (after one line saying so, with the notice), as Python's own
    handler does."""

    def __init__(self, interrupt_notice: str = ""):
        self.received: str | None = None
        self.preempted: str | None = None
        self.interrupted = False
        self.interrupt_notice = interrupt_notice
        self._previous: dict = {}

    def install(self) -> "PreemptionHandler":
        if threading.current_thread() is threading.main_thread():  # signal() works there only
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle_interrupt)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        if self.preempted is None:
            self.preempted = signal.Signals(signum).name
        if self.received is None:
            self.received = self.preempted

    def _handle_interrupt(self, signum, _frame) -> None:
        again = self.interrupted
        self.interrupted = True
        if self.received is None:
            self.received = "SIGINT"
        if again:
            self._say("Ctrl-C again: stopping now, without the checkpoint of this step")
            raise KeyboardInterrupt
        self._say(self.interrupt_notice)

    def _say(self, line: str) -> None:
        # os.write, not print: the handler may run while the main thread is inside a print to
        # the same stream (a reentrant call of a buffered stream raises RuntimeError)
        if line:
            try:
                os.write(2, (line + "\n").encode())
            except OSError:
                pass
