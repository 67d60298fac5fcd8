"""Starts the ranks of one run on this node as one process each and takes them all down together
(stdlib only). Used by every backend whose framework has no launcher worth depending on.

``python -m trainperf.backends.spawn --backend NAME --nproc N [--cluster PATH] -- WORKER_ARGS...``

Local rank ``r`` runs ``python -m trainperf.backends.NAME.worker WORKER_ARGS`` with the variables
that ``trainperf.backends.NAME.backend.rank_env(r, cluster)`` gives: the framework's own way of
naming ranks and rendezvous points. ``cluster`` (``base.Cluster``) says where every node of the
run is and which ports are free on each; the global rank is ``cluster.global_rank(r)``, the world
``cluster.world_size``, and a GPU is picked by the local rank. Without ``--cluster`` (one node) it
is this node alone, over loopback, with ports found free now.

The launcher exits with the first failing rank's code, or 0. When a rank fails, the others
(waiting on it forever in a collective) are stopped after a moment to write their own error;
SIGTERM stops everything. A node supervises its own ranks only: a rank lost on another node shows
here when a local rank's collective gives up on it.

The backends' descriptions (``backend.py``) import this module's helpers inside their functions:
they are imported with the ``trainperf.backends`` package, and this module, imported with it,
would be loaded twice when it then runs as ``__main__`` (runpy warns).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .base import Cluster, LaunchRequest

POLL_S = 0.1
PEER_GRACE_S = 2.0
"""A failing rank writes its error event before it exits; its peers may be mid-way through
writing theirs, so they get a moment before they are stopped."""
PORTS_PER_RUN = 4
"""Each node holds ``PORTS_PER_RUN + nproc`` ports free for a run: ``ports[0]`` of node 0 is the
coordinator (master, scheduler); ``ports[1 + r]`` is local rank ``r``'s endpoint for the
frameworks that give each rank one. A backend uses what it needs."""
LOOPBACK = "127.0.0.1"


def free_ports(n: int, addr: str = LOOPBACK) -> list[int]:
    """``n`` distinct ports free on ``addr`` now (held open together so none is handed out
    twice)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind((addr, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def local_cluster(nproc: int) -> Cluster:
    """One node, over loopback, with ports free now: a single-node run."""
    return Cluster(0, nproc, (LOOPBACK,), (tuple(free_ports(PORTS_PER_RUN + nproc)),))


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


def cluster_args(req: LaunchRequest) -> list[str]:
    """A launcher's ``--cluster`` argument for a multi-node request (none for one node)."""
    if req.cluster is None:
        return []
    if req.cluster_path is None:
        raise ValueError("a multi-node launch request needs the cluster file (cluster_path)")
    return [f"--cluster={req.cluster_path}"]


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


def stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM, then SIGKILL whatever is still running after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def supervise(workers: list[subprocess.Popen], helpers: list[subprocess.Popen] = (),
              shutdown_grace_s: float = 10.0, linger_s: float = 0.0) -> int:
    """Wait for the run: the first failing worker's code (the rest stopped), or 0. Helpers
    (servers, schedulers) serve the workers: stopped when the workers are done, ``linger_s``
    later (workers on other nodes may still be collecting their last answers from them), and
    a crashed helper fails the run, since the workers would wait on it forever."""
    helpers = list(helpers)
    while True:
        codes = [p.poll() for p in workers]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            stop(workers, PEER_GRACE_S)
            stop(helpers, 0.5)
            return failed[0]
        if all(c == 0 for c in codes):
            deadline = time.monotonic() + linger_s
            while time.monotonic() < deadline and any(h.poll() is None for h in helpers):
                time.sleep(POLL_S)
            stop(helpers, shutdown_grace_s)
            return 0
        if any(h.poll() not in (None, 0) for h in helpers):
            stop(workers, PEER_GRACE_S)
            stop(helpers, 0.5)
            return 1
        time.sleep(POLL_S)


def run_supervised(start, linger_s: float = 0.0) -> int:
    """``start()`` -> (workers, helpers); supervise them, stopping all on SIGTERM (130)."""
    workers: list[subprocess.Popen] = []
    helpers: list[subprocess.Popen] = []

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        workers, helpers = start()
        return supervise(workers, helpers, linger_s=linger_s)
    except KeyboardInterrupt:
        stop(workers + helpers, 2.0)
        return 130


def worker_args_after_dashes(args: list[str]) -> list[str]:
    return args[1:] if args[:1] == ["--"] else args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True, help="backend folder name (paddle, jax...)")
    parser.add_argument("--nproc", type=int, required=True, help="ranks on this node")
    parser.add_argument("--cluster", default=None,
                        help="JSON of every node of the run (base.Cluster); none: this node")
    parser.add_argument("--module", default=None, help="the worker's module (tests)")
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

    def start():
        # One node picks its ports only now, so that none goes stale while the launcher starts.
        where = cluster if args.cluster else local_cluster(args.nproc)
        workers = [subprocess.Popen(cmd, env=dict(
            os.environ, TRAINPERF_LOCAL_RANK=str(r), **description.rank_env(r, where)))
            for r in range(args.nproc)]
        return workers, []

    return run_supervised(start)


if __name__ == "__main__":
    sys.exit(main())
