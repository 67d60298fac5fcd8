"""Starts the ranks of one run on this node as one process each and takes them all down together
(stdlib only). Every backend starts its ranks through it (MXNet's launcher adds its scheduler and
servers through the same pieces).

``python -m trainperf.backends.spawn --backend NAME --nproc N [--cluster PATH] [--logs DIR]
[--events FILE] -- WORKER_ARGS...``

Local rank ``r`` runs ``python -m trainperf.backends.NAME.worker WORKER_ARGS`` with the variables
that ``trainperf.backends.NAME.backend.rank_env(r, cluster)`` gives: the framework's own way of
naming ranks and rendezvous points. ``cluster`` (``base.Cluster``) says where every node of the
run is and which ports are free on each; the global rank is ``cluster.global_rank(r)``, the world
``cluster.world_size``, and a GPU is picked by the local rank. Without ``--cluster`` (one node) it
is this node alone, over loopback, with ports reserved now (``ports.reserve``: outside the
kernel's ephemeral range, claimed until the launcher exits). Over several nodes each rank is
also told the interface that holds this node's address in the cluster (``GLOO_SOCKET_IFNAME``,
``gloo_interface_env``), unless the launcher was told one.

The launcher exits with the first failing rank's code, or 0. When a rank fails, the others
(waiting on it forever in a collective) are stopped after a moment to write their own error;
SIGTERM stops everything, after asking each rank still able to answer for its threads' stacks
(a hung run: where each rank was). A rank found suspended (SIGSTOP, a debugger) when the others
are stopped is said so in its ``exit`` event. With ``--logs``, each rank writes its stdout and
stderr into ``DIR/rank-<global rank>.log``; with ``--events``, the launcher appends an ``exit`` event
(``protocol.Exit``) for each rank as it ends. A node supervises its own ranks only: a rank lost
on another node shows here when a local rank's collective gives up on it (and in the runner,
which hears from the other nodes' runners).

The backends' descriptions (``backend.py``) import this module's helpers inside their functions:
they are imported with the ``trainperf.backends`` package, and this module, imported with it,
would be loaded twice when it then runs as ``__main__`` (runpy warns).
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..protocol import EventWriter, Exit
from . import ports
from .base import Cluster, Launch, LaunchRequest

POLL_S = 0.1
STACK_SIGNAL = signal.SIGUSR1
"""Asks a worker to write every thread's Python stack into its output (``faulthandler``,
registered by ``workerkit.worker_entry``) before a hung run is stopped."""
DUMP_WAIT_S = 1.0
PEER_GRACE_S = 2.0
"""A failing rank writes its error event before it exits; its peers may be mid-way through
writing theirs, so they get a moment before they are stopped."""
PORTS_PER_RUN = 4
"""Each node holds ``PORTS_PER_RUN + nproc`` ports free for a run: ``ports[0]`` of node 0 is the
coordinator (master, scheduler); ``ports[1 + r]`` is local rank ``r``'s endpoint for the
frameworks that give each rank one; the last of node 0 is where OneFlow's rank 0 waits for the
others to leave (``oneflow/rendezvous.py``). A backend uses what it needs."""
LOOPBACK = ports.LOOPBACK
_HELD: list[ports.Reservation] = []
"""The reservations of ``local_cluster``, kept until this launcher exits with its ranks."""


def local_cluster(nproc: int) -> Cluster:
    """One node, over loopback, with ports reserved for it until this process exits (``ports``):
    a single-node run started without the runner's cluster file."""
    held = ports.reserve(PORTS_PER_RUN + nproc, LOOPBACK)
    _HELD.append(held)
    return Cluster(0, nproc, (LOOPBACK,), (held.ports,))


def endpoint(addr: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def rank_endpoints(cluster: Cluster) -> list[str]:
    """Every rank's own endpoint, in global rank order: local rank ``r`` of node ``n`` listens
    on ``ports[n][1 + r]`` at ``addrs[n]``."""
    return [endpoint(addr, ports[1 + r]) for addr, ports in zip(cluster.addrs, cluster.ports)
            for r in range(cluster.nproc_per_node)]


def coordinator(cluster: Cluster) -> str:
    """Node 0's first port: where every rank meets (master, coordinator, scheduler)."""
    return endpoint(*cluster.master)


def torch_style_env(local_rank: int, cluster: Cluster) -> dict[str, str]:
    """The variables ``torch.distributed.run`` gives a rank, which torch's ``env://`` and
    OneFlow read: node 0's first port as the master, global rank, local rank, world size."""
    addr, port = cluster.master
    return {"MASTER_ADDR": addr, "MASTER_PORT": str(port),
            "WORLD_SIZE": str(cluster.world_size), "RANK": str(cluster.global_rank(local_rank)),
            "LOCAL_RANK": str(local_rank)}


def is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def interface_of(addr: str) -> str | None:
    """The network interface of this machine that holds ``addr``: ``lo`` for a loopback
    address, else the interface whose IPv4 address it is; None where none does."""
    if is_loopback(addr):
        return "lo"
    import fcntl
    import struct

    siocgifaddr = 0x8915  # <linux/sockios.h>: an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            if socket.inet_ntoa(got[20:24]) == addr:
                return name
    return None


def gloo_interface_env(cluster: Cluster, environ: dict[str, str] | None = None
                       ) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` for the ranks of a run over several nodes: the interface that
    holds this node's address in the cluster. Gloo (torch's, Paddle's, and JAX's through
    ``jax/dist.py``) otherwise binds to what the host name resolves to, which on a host with
    several networks, or in a network namespace, is not the network the nodes meet on (in an
    emulated node it is loopback, which the other node cannot reach). Nothing where the caller
    named an interface already (the runner sets the one its nodes met on), where the run has
    one node, or where no interface holds the address (a host name: gloo's own choice then)."""
    environ = os.environ if environ is None else environ
    if cluster.nnodes < 2 or "GLOO_SOCKET_IFNAME" in environ:
        return {}
    iface = interface_of(cluster.addrs[cluster.node_rank])
    return {"GLOO_SOCKET_IFNAME": iface} if iface else {}


def cluster_args(req: LaunchRequest) -> list[str]:
    """A launcher's ``--cluster`` argument for a multi-node request (none for one node)."""
    if req.cluster is None:
        return []
    if req.cluster_path is None:
        raise ValueError("a multi-node launch request needs the cluster file (cluster_path)")
    return [f"--cluster={req.cluster_path}"]


def output_args(req: LaunchRequest) -> list[str]:
    """A launcher's ``--logs``/``--events`` arguments (``add_output_args``)."""
    if req.logs_dir is None:
        return []
    return [f"--logs={req.logs_dir}", f"--events={req.events_path}"]


def spawn_launch(req: LaunchRequest, backend: str, env: dict[str, str] | None = None
                 ) -> Launch:
    """The launch of a backend whose ranks this module starts."""
    return Launch([req.python, "-m", "trainperf.backends.spawn", f"--backend={backend}",
                   f"--nproc={req.topology.devices_per_node}", *cluster_args(req),
                   *output_args(req), "--", *req.worker_args], env or {})


def read_cluster(path: str, nproc: int) -> Cluster:
    """The cluster the runner wrote for this run; ValueError where it cannot serve ``nproc``
    ranks per node."""
    cluster = Cluster.from_json(Path(path).read_text(encoding="utf-8"))
    if cluster.nproc_per_node != nproc:
        raise ValueError(f"--nproc {nproc} but the cluster file has {cluster.nproc_per_node} "
                         f"ranks per node")
    short = [n for n, p in enumerate(cluster.ports) if len(p) < PORTS_PER_RUN + nproc]
    if short:
        raise ValueError(f"the cluster file gives node(s) {short} fewer than "
                         f"{PORTS_PER_RUN + nproc} ports")
    return cluster


@dataclass
class Member:
    """One process of the run that a launcher started and answers for."""

    proc: subprocess.Popen
    rank: int
    """Its global rank; -1 for a helper (a parameter server, a scheduler)."""
    process: str = ""
    """What a helper is (``scheduler``, ``server on node 1``); empty for a rank."""
    log: str | None = None
    """The file its stdout and stderr go to (None: the launcher's own)."""
    stopped: bool = False
    """The launcher signalled it to stop before it had ended on its own."""
    suspended: bool = False
    """When the launcher came to stop it, it was suspended (stopped by SIGSTOP or a debugger):
    it had made no progress since then, whatever its peers waited on."""
    stack_dumped: bool = False
    """It was asked to write every thread's stack (``STACK_SIGNAL``) before it was stopped."""
    reported: bool = False

    @property
    def name(self) -> str:
        return self.process or f"rank {self.rank}"


class Members:
    """The processes of one run on this node: starts them, each writing into its own file in
    ``logs``, and appends an ``exit`` event (``protocol.Exit``) to ``events`` for each one as it
    ends, so that the runner can say which process died first and how."""

    def __init__(self, logs: str | None = None, events: str | None = None) -> None:
        self.logs = Path(logs) if logs else None
        self.events = events
        self.workers: list[Member] = []
        self.helpers: list[Member] = []

    def start(self, argv: list[str], env: dict[str, str], rank: int, process: str = ""
              ) -> Member:
        log = None
        out = None
        if self.logs is not None:
            self.logs.mkdir(parents=True, exist_ok=True)
            name = process.replace(" ", "-") if process else f"rank-{rank}"
            log = str(self.logs / f"{name}.log")
            out = open(log, "ab")
        try:
            proc = subprocess.Popen(argv, env=env, stdout=out,
                                    stderr=subprocess.STDOUT if out else None)
        finally:
            if out is not None:
                out.close()  # the child holds its own copy
        member = Member(proc, rank, process, log)
        (self.helpers if process else self.workers).append(member)
        return member

    @property
    def all(self) -> list[Member]:
        return self.workers + self.helpers

    def report_ended(self) -> None:
        """An ``exit`` event for every process that has ended since the last call."""
        for m in self.all:
            if m.reported or m.proc.poll() is None:
                continue
            m.reported = True
            if self.events:
                EventWriter(self.events, m.rank).emit(Exit(
                    returncode=m.proc.returncode, stopped=m.stopped, process=m.process,
                    log=m.log, suspended=m.suspended, stack_dumped=m.stack_dumped))


def process_state(pid: int) -> str:
    """The kernel's one-letter state of a process (``R``, ``S``, ``D``, ``T`` for stopped by a
    signal, ``t`` for stopped by a tracer...); empty where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def look_before_stopping(members: list[Member], dump_stacks: bool) -> None:
    """Note which live members are suspended, and, with ``dump_stacks`` (the run hung or was
    stopped from outside), ask every other live rank to write its threads' stacks into its own
    output file (``STACK_SIGNAL``, which the worker's fault handler answers), giving them
    ``DUMP_WAIT_S`` to do it: where each rank was, said by the ranks that could still speak."""
    asked = False
    for m in members:
        if m.proc.poll() is not None:
            continue
        if process_state(m.proc.pid) in ("T", "t"):
            m.suspended = True
        elif dump_stacks and m.rank >= 0 and not m.stack_dumped:
            try:
                os.kill(m.proc.pid, STACK_SIGNAL)
                m.stack_dumped = asked = True
            except ProcessLookupError:
                pass
    if asked:
        time.sleep(DUMP_WAIT_S)


def stop(members: list[Member], grace_s: float) -> None:
    """SIGTERM, then SIGKILL whatever is still running after ``grace_s``; a suspended process
    gets SIGKILL at once (SIGTERM would wait, pending, until it were resumed)."""
    for m in members:
        if m.proc.poll() is None:
            m.stopped = True
            if m.suspended:
                m.proc.kill()
            else:
                m.proc.terminate()
    deadline = time.monotonic() + grace_s
    for m in members:
        try:
            m.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            m.proc.kill()
            m.proc.wait()


def supervise(members: Members, shutdown_grace_s: float = 10.0, linger_s: float = 0.0) -> int:
    """Wait for the run: the first failing worker's code (the rest stopped), or 0. Helpers
    (servers, schedulers) serve the workers: stopped when the workers are done, ``linger_s``
    later (workers on other nodes may still be collecting their last answers from them), and
    a crashed helper fails the run, since the workers would wait on it forever."""
    workers, helpers = members.workers, members.helpers
    try:
        while True:
            members.report_ended()
            codes = [m.proc.poll() for m in workers]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                look_before_stopping(workers, dump_stacks=False)
                stop(workers, PEER_GRACE_S)
                stop(helpers, 0.5)
                return failed[0]
            if all(c == 0 for c in codes):
                deadline = time.monotonic() + linger_s
                while time.monotonic() < deadline and any(h.proc.poll() is None
                                                          for h in helpers):
                    time.sleep(POLL_S)
                stop(helpers, shutdown_grace_s)
                return 0
            if any(h.proc.poll() not in (None, 0) for h in helpers):
                look_before_stopping(workers, dump_stacks=False)
                stop(workers, PEER_GRACE_S)
                stop(helpers, 0.5)
                return 1
            time.sleep(POLL_S)
    finally:
        members.report_ended()


def run_supervised(start: Callable[[Members], None], members: Members,
                   linger_s: float = 0.0) -> int:
    """``start(members)`` starts the run's processes; supervise them, stopping all on SIGTERM
    (130)."""

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        start(members)
        return supervise(members, linger_s=linger_s)
    except KeyboardInterrupt:
        look_before_stopping(members.all, dump_stacks=True)
        stop(members.all, 2.0)
        members.report_ended()
        return 130


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """The options every launcher takes for its processes' output and exit events."""
    parser.add_argument("--logs", default=None,
                        help="folder for one output file per process (none: this launcher's "
                             "own stdout and stderr)")
    parser.add_argument("--events", default=None,
                        help="JSON-lines file to append an exit event per process to")


def worker_args_after_dashes(args: list[str]) -> list[str]:
    return args[1:] if args[:1] == ["--"] else args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True, help="backend folder name (paddle, jax...)")
    parser.add_argument("--nproc", type=int, required=True, help="ranks on this node")
    parser.add_argument("--cluster", default=None,
                        help="JSON of every node of the run (base.Cluster); none: this node")
    parser.add_argument("--module", default=None, help="the worker's module (tests)")
    add_output_args(parser)
    parser.add_argument("worker_args", nargs=argparse.REMAINDER,
                        help="after --: the worker's arguments (--spec ... --events ...)")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    if args.cluster:
        try:
            cluster = read_cluster(args.cluster, args.nproc)
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--cluster {args.cluster}: {exc}")
    description = importlib.import_module(f"trainperf.backends.{args.backend}.backend")
    module = args.module or f"trainperf.backends.{args.backend}.worker"
    cmd = [sys.executable, "-m", module, *worker_args_after_dashes(args.worker_args)]

    def start(members: Members) -> None:
        # One node picks its ports only now, so that none goes stale while the launcher starts.
        where = cluster if args.cluster else local_cluster(args.nproc)
        base = dict(os.environ, **gloo_interface_env(where))
        for r in range(args.nproc):
            members.start(cmd, dict(base, TRAINPERF_LOCAL_RANK=str(r),
                                    **description.rank_env(r, where)), where.global_rank(r))

    return run_supervised(start, Members(args.logs, args.events))


if __name__ == "__main__":
    sys.exit(main())
