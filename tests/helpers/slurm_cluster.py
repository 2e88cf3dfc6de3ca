"""A one-node Slurm in a temporary directory, for tests that submit real batch jobs.

Debian's ``slurm-wlm`` and ``munge`` (``apt-get install -y slurm-wlm munge``), run as root: this
host is the node (its short hostname, the CPUs and memory ``slurmd -C`` reports), ``munged``
runs on its own key and socket, ``slurmctld`` and ``slurmd`` on ports chosen free, with every
state, spool, pid and log file under the directory. The clients find the cluster through
``SLURM_CONF`` (:attr:`SlurmCluster.env`). The daemons run in the foreground as children of
the test process and are stopped by pid (:meth:`SlurmCluster.stop`). By hand, the same:

    .venv/bin/python -m tests.helpers.slurm_cluster /tmp/slurm   # prints the SLURM_CONF line; Ctrl-C stops it

Settings that keep the tests short: ``cred_expire=5`` (a requeued job may start again after
6 s instead of 121 s), ``sched_interval=1`` (the scheduler looks at pending jobs every second
instead of every minute), ``JobRequeue=1``; no accounting (``scontrol show job`` reports a job
for ``MinJobAge``, 300 s, after it ends).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.helpers.launch import _free_port

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "squeue")


def missing() -> str | None:
    """Why a real Slurm cannot run here (one line), or None."""
    absent = [p for p in PROGRAMS if shutil.which(p, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if absent:
        return f"needs Slurm and munge ({', '.join(absent)} not found): apt-get install -y slurm-wlm munge"
    if os.geteuid() != 0:
        return "needs root (slurmd starts the jobs)"
    return None


def _which(program: str) -> str:
    return shutil.which(program, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def node_hardware() -> dict:
    """``slurmd -C``'s ``CPUs`` and ``RealMemory`` of this host."""
    text = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=True, timeout=30).stdout
    fields = dict(re.findall(r"(\w+)=(\S+)", text.splitlines()[0]))
    return {"CPUs": fields["CPUs"], "RealMemory": fields["RealMemory"]}


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen] = {}

    # -- start and stop -----------------------------------------------------------------------

    def start(self, timeout: float = 30) -> "SlurmCluster":
        """Write the key and slurm.conf, start munged, slurmctld and slurmd; return once the node is idle."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge = self.root / "munge"
        socket_path = munge / "munge.socket"
        if len(str(socket_path)) > 100:
            raise RuntimeError(f"{socket_path}: too long for a Unix socket")
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # --force: the socket's directory sits in a private temporary directory, not world-executable
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--socket={socket_path}",
                               f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
                               f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"])
        self._wait(lambda: socket_path.exists(), timeout, "munged's socket")
        self.conf.write_text(self.slurm_conf(str(socket_path)))
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i"])
        self._spawn("slurmd", [_which("slurmd"), "-D", "-N", self.node])
        self._wait(lambda: self._node_state() == "idle", timeout, f"node {self.node} idle")

    def slurm_conf(self, munge_socket: str) -> str:
        hw = node_hardware()
        r = self.root
        ctld_port = _free_port()
        slurmd_port = next(p for p in iter(_free_port, None) if p != ctld_port)
        return "\n".join([
            "ClusterName=bebop-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket},cred_expire=5",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",
            "JobRequeue=1",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "MailProg=/bin/true",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={hw['CPUs']} RealMemory={hw['RealMemory']} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def stop(self, timeout: float = 30) -> None:
        """Cancel what still runs, then end the daemons (slurmd, slurmctld, munged) by pid."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run([_which("scancel"), "--full", "--user", "root"], env=self.env, capture_output=True,
                           timeout=30)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.squeue():
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        log.close()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {self.daemon_log(name)[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not ready after {timeout:.0f}s; " + "; ".join(
                    f"{n}: {self.daemon_log(n)[-1000:]}" for n in self.procs))
            time.sleep(0.1)

    def daemon_log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def _node_state(self) -> str:
        proc = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True,
                              timeout=30)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    # -- the clients --------------------------------------------------------------------------

    def run(self, *cmd: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([_which(cmd[0]), *cmd[1:]], env={**self.env, **(env or {})}, cwd=cwd,
                              capture_output=True, text=True, timeout=60)

    def sbatch(self, *args: str, env: dict | None = None, cwd: Path | None = None) -> int:
        """Submit; the job id."""
        proc = self.run("sbatch", "--parsable", *args, env=env, cwd=cwd)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed with {proc.returncode}: {proc.stderr}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """``scontrol show job``'s fields (``JobState``, ``Restarts``, ``ExitCode``, ...)."""
        proc = self.run("scontrol", "show", "job", "-o", str(job_id))
        if proc.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id}: {proc.stderr}")
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def squeue(self) -> list[str]:
        proc = self.run("squeue", "-h", "-o", "%i")
        return proc.stdout.split()

    def wait_job(self, job_id: int, until, timeout: float, what: str) -> dict:
        """Poll ``scontrol show job`` (twice a second: a poll costs ~7 ms of CPU) until ``until(fields)``;
        fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if until(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: {what} not reached in {timeout:.0f}s (JobState="
                                     f"{fields.get('JobState')} Reason={fields.get('Reason')} "
                                     f"Restarts={fields.get('Restarts')})")
            time.sleep(0.5)


def _interrupt(signum, _frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    import sys

    signal.signal(signal.SIGTERM, _interrupt)
    cluster = SlurmCluster(Path(sys.argv[1]).resolve()).start()
    print(f"export SLURM_CONF={cluster.conf}   # one node: {cluster.node}; Ctrl-C (or kill {os.getpid()}) stops "
          "the daemons", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
