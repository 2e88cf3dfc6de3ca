"""A one-node or two-node Slurm in a temporary directory, for tests that submit real batch jobs.

Debian's ``slurm-wlm`` and ``munge`` (``apt-get install -y slurm-wlm munge``), run as root.
One node: this host is the node (its short hostname, the CPUs and memory ``slurmd -C``
reports). Two nodes (``nodes=2``; also ``iproute2``): ``node1`` and ``node2``, one ``slurmd``
each in its own network namespace (:class:`NodeNetwork`: ``ip netns``, a veth pair per node on a
bridge of this host, addresses of 198.18.0.0/15, the range set aside for benchmarks), under its
own hostname (a UTS namespace) with an ``/etc/hosts`` that names both nodes (bind-mounted in
the node's mount namespace), so that a job's ``srun``, ``torchrun``'s rendezvous and gloo cross
hosts as they would on a cluster; ``slurmctld`` listens on the bridge's address. The test
creates the namespaces, the bridge and the veths and removes them (:meth:`SlurmCluster.stop`).
Either way ``munged`` runs on its own key and socket (a file, reachable from every
namespace), ``slurmctld`` and ``slurmd`` on ports chosen free, with every state, spool, pid and
log file under the directory. The clients find the cluster through ``SLURM_CONF``
(:attr:`SlurmCluster.env`). The daemons run in the foreground as children of the test process
and are stopped by pid (:meth:`SlurmCluster.stop`). By hand, the same:

    .venv/bin/python -m tests.helpers.slurm_cluster /tmp/slurm [--nodes 2]   # prints SLURM_CONF; Ctrl-C stops it

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
NETNS_PROGRAMS = {"ip": "iproute2", "nsenter": "util-linux", "unshare": "util-linux", "mount": "mount",
                  "hostname": "hostname"}  # and their Debian packages


def missing() -> str | None:
    """Why a real Slurm cannot run here (one line), or None."""
    absent = [p for p in PROGRAMS if _which(p) is None]
    if absent:
        return f"needs Slurm and munge ({', '.join(absent)} not found): apt-get install -y slurm-wlm munge"
    if os.geteuid() != 0:
        return "needs root (slurmd starts the jobs)"
    return None


def missing_namespaces() -> str | None:
    """Why this host cannot give two nodes their own network namespaces (one line), or None:
    creates and removes a namespace, a bridge and a veth pair of its own to find out."""
    absent = [p for p in NETNS_PROGRAMS if _which(p) is None]
    if absent:
        packages = sorted({NETNS_PROGRAMS[p] for p in absent})
        return f"a two-node Slurm needs {', '.join(absent)} (not found): apt-get install -y {' '.join(packages)}"
    probe = NodeNetwork(1, tag="probe")
    try:
        probe.create()
    except RuntimeError as err:
        return f"a two-node Slurm needs network namespaces, which this machine cannot create ({err})"
    finally:
        probe.remove()
    return None


def _which(program: str) -> str | None:
    return shutil.which(program, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def node_hardware() -> dict:
    """``slurmd -C``'s ``CPUs`` and ``RealMemory`` of this host."""
    text = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=True, timeout=30).stdout
    fields = dict(re.findall(r"(\w+)=(\S+)", text.splitlines()[0]))
    return {"CPUs": fields["CPUs"], "RealMemory": fields["RealMemory"]}


class NodeNetwork:
    """``nodes`` network namespaces (``bebop-<pid>-node<i>``), each with one end of a veth pair
    (``bb<pid>p<i>``, address ``<subnet>.<i>``) whose other end (``bb<pid>n<i>``) is a port of the
    bridge ``bb<pid>`` (``<subnet>.254``, the controller's address); ``<subnet>`` is a /24 of
    198.18.0.0/15 that no address of this host is in. Names carry this process's id, so that
    concurrent test sessions do not collide. :meth:`run_as` wraps a command to run as node ``i``."""

    def __init__(self, nodes: int, tag: str = ""):
        pid = os.getpid()
        self.prefix = f"bb{tag[:1]}{pid}"  # interface names: at most 15 characters
        self.names = [f"bebop-{tag}{pid}-node{i}" for i in range(1, nodes + 1)]
        self.bridge = self.prefix
        self.subnet: str | None = None

    def _ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([_which("ip"), *args], capture_output=True, text=True, timeout=30)
        if check and proc.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
        return proc

    def _free_subnet(self) -> str:
        used = set(re.findall(r"inet (\d+\.\d+\.\d+)\.\d+/", self._ip("-o", "-4", "addr", "show").stdout))
        start = os.getpid() % 256
        for k in range(512):
            n = (start + k) % 512
            subnet = f"198.{18 + n // 256}.{n % 256}"
            if subnet not in used:
                return subnet
        raise RuntimeError("no free /24 in 198.18.0.0/15")

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def controller(self) -> str:
        return f"{self.subnet}.254"

    def create(self) -> None:
        """The bridge, then per node: its namespace, its veth pair, addresses, links up."""
        self.remove()  # what a killed earlier process of the same id may have left
        self.subnet = self._free_subnet()
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.controller}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            outer, inner = f"{self.prefix}n{i + 1}", f"{self.prefix}p{i + 1}"
            self._ip("netns", "add", ns)
            self._ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
            self._ip("link", "set", outer, "master", self.bridge, "up")
            self._ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inner)
            self._ip("-n", ns, "link", "set", inner, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")

    def remove(self) -> None:
        """Delete the veths, the bridge and the namespaces that exist (each is tried; none is required)."""
        for i, ns in enumerate(self.names):
            self._ip("link", "del", f"{self.prefix}n{i + 1}", check=False)
            self._ip("netns", "del", ns, check=False)
        self._ip("link", "del", self.bridge, check=False)

    def run_as(self, i: int, hostname: str, hosts_file: Path, cmd: list[str]) -> list[str]:
        """``cmd`` in namespace ``i`` (``nsenter``; not ``ip netns exec``, which mounts a /sys without
        the cgroup filesystem that slurmd reads), in UTS and mount namespaces of its own: hostname
        ``hostname``, ``hosts_file`` as ``/etc/hosts``. Each step execs the next: the pid is ``cmd``'s."""
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        return [_which("nsenter"), f"--net=/run/netns/{self.names[i]}", _which("unshare"), "--uts", "--mount", "sh",
                "-c", script, "sh", hostname, str(hosts_file), *cmd]


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 1):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.network = NodeNetwork(nodes) if nodes > 1 else None
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)] if self.network else [self.host]
        self.node = self.nodes[0]
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen] = {}

    # -- start and stop -----------------------------------------------------------------------

    def start(self, timeout: float = 30) -> "SlurmCluster":
        """Write the key and slurm.conf, start munged, slurmctld and the slurmd; return once every node is idle."""
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
        if self.network:
            self.network.create()
        self.conf.write_text(self.slurm_conf(str(socket_path)))
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i"])
        if not self.network:
            self._spawn("slurmd", [_which("slurmd"), "-D", "-N", self.node])
        else:
            hosts = self.root / "hosts"
            hosts.write_text("".join(f"{addr} {name}\n" for addr, name in [
                ("127.0.0.1", "localhost"), ("::1", "localhost"), (self.network.controller, self.host),
                *((self.network.address(i), node) for i, node in enumerate(self.nodes))]))
            for i, node in enumerate(self.nodes):
                (self.root / "spool" / node).mkdir(exist_ok=True)
                self._spawn(f"slurmd-{node}", self.network.run_as(i, node, hosts, [_which("slurmd"), "-D", "-N", node]))
        self._wait(lambda: self.node_states() == ["idle"] * len(self.nodes), timeout, "every node idle")

    def slurm_conf(self, munge_socket: str) -> str:
        hw = node_hardware()
        r = self.root
        ctld_port = _free_port()
        slurmd_port = next(p for p in iter(_free_port, None) if p != ctld_port)
        if self.network:  # one slurmd per namespace: their files apart by node name (%n)
            ctld_addr = self.network.controller
            addrs = [self.network.address(i) for i in range(len(self.nodes))]
            slurmd_files = [f"SlurmdSpoolDir={r / 'spool' / '%n'}", f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
                            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}"]
        else:
            ctld_addr, addrs = "127.0.0.1", ["127.0.0.1"]
            slurmd_files = [f"SlurmdSpoolDir={r / 'spool'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
                            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}"]
        return "\n".join([
            "ClusterName=bebop-test",
            f"SlurmctldHost={self.host}({ctld_addr})",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket},cred_expire=5",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            *slurmd_files,
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
            *(f"NodeName={node} NodeAddr={addr} CPUs={hw['CPUs']} RealMemory={hw['RealMemory']} State=UNKNOWN"
              for node, addr in zip(self.nodes, addrs)),
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def stop(self, timeout: float = 30) -> None:
        """Cancel what still runs, end the daemons (the slurmd, slurmctld, munged) by pid, then remove
        the nodes' namespaces, veths and bridge."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run([_which("scancel"), "--full", "--user", "root"], env=self.env, capture_output=True,
                           timeout=30)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.squeue():
                time.sleep(0.2)
        slurmd = [name for name in self.procs if name.startswith("slurmd")]
        for name in (*slurmd, "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.network:
            self.network.remove()

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

    def node_states(self) -> list[str]:
        """``sinfo``'s state of each node, in :attr:`nodes`' order ([] while slurmctld does not answer)."""
        proc = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True,
                              text=True, timeout=30)
        states = dict(line.split() for line in proc.stdout.splitlines()) if proc.returncode == 0 else {}
        return [states[node] for node in self.nodes] if set(states) == set(self.nodes) else []

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

    @staticmethod
    def ranks_on(node: str) -> list[int]:
        """The pids of the ranks that jobs run on ``node``: processes whose environment has
        ``SLURMD_NODENAME=node`` (slurmstepd sets it for a job's tasks) and torchrun's ``LOCAL_RANK``
        (set for its workers, not for itself)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            if f"SLURMD_NODENAME={node}".encode() in environ and any(v.startswith(b"LOCAL_RANK=") for v in environ):
                pids.append(int(entry.name))
        return pids

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
    import argparse

    parser = argparse.ArgumentParser(description="A Slurm of this host in DIR, until Ctrl-C or SIGTERM.")
    parser.add_argument("dir")
    parser.add_argument("--nodes", type=int, default=1,
                        help="more than 1: node1, node2, ..., each in its own network namespace")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    cluster = SlurmCluster(Path(args.dir).resolve(), nodes=args.nodes).start()
    print(f"export SLURM_CONF={cluster.conf}   # nodes: {' '.join(cluster.nodes)}; Ctrl-C (or kill {os.getpid()}) "
          "stops the daemons", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
