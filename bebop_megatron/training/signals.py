"""Preemption: SIGTERM or SIGUSR1 ask for a checkpoint and an exit the launcher requeues.

Slurm sends SIGUSR1 before the time limit (``#SBATCH --signal``) and SIGTERM on preemption;
``slurm/train_tv.sbatch`` forwards them to every rank through srun and torchrun. The handler
only records the signal; the trainer agrees on it across ranks at the next step boundary
(ranks may receive it at different steps), finishes that step, saves a complete checkpoint
and exits with :data:`REQUEUE_EXIT_CODE`.
"""

from __future__ import annotations

import signal
import threading

REQUEUE_EXIT_CODE = 75
"""Exit status after a preemption checkpoint (``EX_TEMPFAIL``: "try again later")."""

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written; exits with :data:`REQUEUE_EXIT_CODE`."""

    def __init__(self, message: str):
        super().__init__(REQUEUE_EXIT_CODE)
        self.message = message


def stop_message(received: str | None, checkpoint: str | None, step: int, launcher_gone: int | None = None) -> str:
    """The trainer's last line after a stop signal: what happened, where it stopped, its exit status.

    ``launcher_gone``: the pid of a launcher found gone (:func:`bebop_megatron.launcher.gone`);
    its watchdog sent the SIGTERM, and no launcher is left to requeue the job."""
    where = f"checkpoint {checkpoint or '(none: save.dir is null)'} at step {step}"
    if launcher_gone is not None:
        why = f"the launcher (pid {launcher_gone}) is gone" + (f" ({received})" if received else "")
        return f"{why}: {where}; stopped with exit status {REQUEUE_EXIT_CODE} (train.resume=auto continues from it)"
    return f"{received or 'preemption signal'}: {where}; exiting with {REQUEUE_EXIT_CODE} so that the launcher " \
        "requeues the job"


class PreemptionHandler:
    """Records SIGTERM / SIGUSR1; ``received`` is the name of the first one, else None."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    def install(self) -> "PreemptionHandler":
        if threading.current_thread() is threading.main_thread():  # signal() works there only
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
