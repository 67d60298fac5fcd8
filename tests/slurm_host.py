"""A real Slurm on this one host for the tests: munged, slurmctld and one slurmd per node
(``NODES`` of them, Slurm's own several-daemons-per-host setup: each its node name, port and
spool) started from a temporary folder, with their own ports, socket and configuration, so they
touch neither a Slurm nor a munge the host may already run, and are all stopped afterwards.
Jobs see a cluster of two nodes and run on both, as on two hosts.

    python tests/slurm_host.py install   # Debian's slurm-wlm and munge, best effort (make test)

Tests take the ``slurm_cluster`` fixture; where the cluster cannot start it skips them with the
step that failed.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from run_util import reserved_ports

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
PACKAGES = ("slurm-wlm", "munge")
INSTALL_HINT = "`python tests/slurm_host.py install` (run by `make test`) installs them"
START_TIMEOUT_S = 30.0
NODES = 2
STOP_TIMEOUT_S = 10.0


class Unavailable(RuntimeError):
    """The cluster cannot start here; the message says which step failed."""


def missing_programs() -> list[str]:
    return [p for p in DAEMONS + CLIENTS if shutil.which(p) is None]


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


class SlurmHost:
    """One single-node cluster: ``start()`` raises ``Unavailable``, ``stop()`` always cleans up
    (it is safe to call twice and after a start that failed half way)."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.conf: Path | None = None
        self.node = socket.gethostname().split(".")[0]
        self.nodes = [f"tpnode{i}" for i in range(NODES)]
        """Slurm's names of the cluster's nodes, every one of them this host (reached at
        127.0.0.1, its NodeAddr); the first is where a job's nodes meet."""
        self.partition = "trainperf"
        self.procs: dict[str, subprocess.Popen] = {}
        self._old_conf: str | None = None
        self._env_set = False

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        if os.geteuid() != 0:
            raise Unavailable("a test Slurm needs root (slurmd starts jobs as their users)")
        missing = missing_programs()
        if missing:
            raise Unavailable(f"Slurm is not installed (missing {', '.join(missing)}); "
                              f"{INSTALL_HINT}")
        try:
            socket.gethostbyname(self.node)
        except OSError:
            raise Unavailable(f"this host's name {self.node!r} does not resolve; the jobs "
                              f"meet at it") from None
        atexit.register(self.stop)  # a session stopped by Ctrl-C still leaves no daemons
        # A short path of its own: munge's and slurmstepd's sockets live under it, and a Unix
        # socket's path must stay under about 100 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="trainperf-slurm-"))
        self._start_munge()
        self.conf = self._write_conf()
        self._old_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(self.conf)  # every client (and the jobs) use this one
        self._env_set = True
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._wait("slurmctld to answer", self._controller_up)
        for name in self.nodes:
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        self._wait(f"nodes {', '.join(self.nodes)} to be idle", self._node_idle)

    def _start_munge(self) -> None:
        assert self.root is not None
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = munge / "munge.socket"
        # --force: the socket's folder is private to root, which munged would otherwise refuse
        # for lack of "execute for all" (only root talks to it here).
        self._spawn("munged", ["munged", "--foreground", "--force",
                               f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--log-file={munge / 'munged.log'}",
                               f"--pid-file={munge / 'munged.pid'}",
                               f"--seed-file={munge / 'munged.seed'}"])
        self._wait("munged's socket", self.munge_socket.exists)

    def _node_lines(self) -> list[str]:
        """Each node as slurmd sees this host (CPUs, sockets, cores, threads, memory), so the
        controller does not drain one for a mismatch; every node this host, on a port of its
        own."""
        try:
            out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True,
                                 timeout=30).stdout
            line = next(ln for ln in out.splitlines() if ln.startswith("NodeName="))
        except (OSError, subprocess.SubprocessError, StopIteration):
            mib = psutil.virtual_memory().total // 2**20
            line = f"NodeName={self.node} CPUs={os.cpu_count() or 1} RealMemory={mib}"
        fields = [f for f in line.split() if not f.startswith("NodeName=")]
        ports = reserved_ports(len(self.nodes))
        return [" ".join([f"NodeName={name}", f"NodeHostname={self.node}",
                          "NodeAddr=127.0.0.1", f"Port={port}", *fields, "State=UNKNOWN"])
                for name, port in zip(self.nodes, ports)]

    def _write_conf(self) -> Path:
        assert self.root is not None
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir()
        r = self.root
        lines = [
            "ClusterName=trainperf-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            # Ports of its own, so a Slurm already on the host (6817/6818) is left alone.
            f"SlurmctldPort={reserved_ports()[0]}",

            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'state'}",
            # %n: each node's daemon its own spool, pid file and log.
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd'}-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd'}-%n.log",
            # No cgroups, no accounting daemon: what a container or a bare VM can run.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            # Trust the node line even where slurmd counts the hardware differently.
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            # A finished job stays visible (squeue, scontrol) for this long: enough for the
            # test to read its end, short enough not to pile up.
            "MinJobAge=60",
            "KillWait=5",
            *self._node_lines(),
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES "
            "MaxTime=INFINITE State=UP",
        ]
        conf = r / "slurm.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def _spawn(self, name: str, argv: list[str]) -> None:
        assert self.root is not None
        log = open(self.root / f"{name}.stdout", "wb")
        env = dict(os.environ)
        if self.conf is not None:
            env["SLURM_CONF"] = str(self.conf)
        # A session of its own: a Ctrl-C meant for pytest must not kill the daemons before
        # stop() has cancelled the jobs they run.
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)
        log.close()

    def _wait(self, what: str, ready) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise Unavailable(f"{name} exited ({proc.returncode}) while waiting for "
                                      f"{what}: {self._log_of(name)}")
            if ready():
                return
            time.sleep(0.2)
        daemon = next((n for n in self.procs if n.startswith("slurmd")), "slurmctld")
        raise Unavailable(f"timed out after {START_TIMEOUT_S:.0f} s waiting for {what}: "
                          f"{self._log_of(daemon)}")

    def _log_of(self, name: str) -> str:
        assert self.root is not None
        logs = {"munged": self.root / "munge" / "munged.log",
                "slurmctld": self.root / "log" / "slurmctld.log",
                **{f"slurmd-{n}": self.root / "log" / f"slurmd-{n}.log" for n in self.nodes}}
        for path in (logs.get(name), self.root / f"{name}.stdout"):
            if path is not None and path.exists() and path.stat().st_size:
                return _tail(path)
        return "(no log)"

    def _query(self, argv: list[str]) -> str | None:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout if out.returncode == 0 else None

    def _controller_up(self) -> bool:
        return "UP" in (self._query(["scontrol", "ping"]) or "")

    def _node_idle(self) -> bool:
        states = (self._query(["sinfo", "-h", "-N", "-o", "%N %T"]) or "").split("\n")
        idle = {ln.split()[0] for ln in states if ln.split()[1:] == ["idle"]}
        return idle >= set(self.nodes)

    # -- while running ----------------------------------------------------------------------

    def job_ids(self) -> list[str]:
        """Jobs the controller still lists (pending, running or completing)."""
        out = self._query(["squeue", "-h", "-o", "%i"])
        return out.split() if out else []

    # -- stop -------------------------------------------------------------------------------

    def stop(self) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._cancel_jobs()
        daemons = [n for n in self.procs if n.startswith("slurmd")]
        for name in (*daemons, "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                _end(proc)
        self._end_job_processes()
        if self._env_set:
            if self._old_conf is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = self._old_conf
            self._env_set = False
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def _cancel_jobs(self) -> None:
        ids = self.job_ids()
        if not ids:
            return
        subprocess.run(["scancel", *ids], capture_output=True, timeout=30)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.job_ids() and time.monotonic() < deadline:
            time.sleep(0.3)

    def _end_job_processes(self) -> None:
        """slurmstepd leaves slurmd's process tree at once, so a job the controller could not
        end would outlive the daemons: find its processes by this cluster's configuration,
        which every one of them inherits."""
        if self.conf is None:
            return
        mine = str(self.conf)
        left = []
        for p in psutil.process_iter():
            if p.pid == os.getpid():
                continue
            try:
                if p.environ().get("SLURM_CONF") == mine:
                    left.append(p)
            except psutil.Error:
                continue
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=STOP_TIMEOUT_S)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def slurm_cluster():
    """A started cluster of two nodes on this host (``SLURM_CONF`` points at it while the
    module runs), or a skip that names what failed."""
    host = SlurmHost()
    try:
        host.start()
    except Unavailable as exc:
        host.stop()
        pytest.skip(f"no test Slurm: {exc}")
    except BaseException:
        host.stop()
        raise
    try:
        yield host
    finally:
        host.stop()


# -- install ---------------------------------------------------------------------------------

def install() -> int:
    """Install Debian's Slurm and munge where they are missing and apt can (best effort)."""
    from debian_packages import install as install_packages

    return install_packages("slurm_host", PACKAGES, missing_programs, "the Slurm test")


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python tests/slurm_host.py install")
    sys.exit(install())
