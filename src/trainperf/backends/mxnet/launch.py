"""Starts the processes of one MXNet run on this node and takes them all down together (stdlib
only).

``python -m trainperf.backends.mxnet.launch --nproc N --kvstore KIND [--cluster PATH] [--logs DIR]
[--events FILE] -- ARGS...`` (``--logs``/``--events``: as ``trainperf.backends.spawn``'s, the
scheduler's and servers' output and exits included)

- ``local``: one worker process on one context.
- ``device``: one worker process with N contexts and kvstore ``device`` (how insightface's MXNet
  ArcFace and gluon-cv trained on one machine).
- ``dist_sync``: N workers on this node, each one rank, and a parameter server; the scheduler
  runs on the first node only. One node: all over loopback. Several nodes (``--cluster``, a
  ``base.Cluster`` as JSON): the scheduler listens on node 0's first port, every node runs one
  server (``DMLC_NUM_SERVER`` = nodes) and its N workers (``DMLC_NUM_WORKER`` = every node's).
  (``mxnet.tools.launch`` does this too, but it breaks on Python 3.11.)

ps-lite numbers the workers itself, in an order of its own (it sorts them by host and port), not
by node. Each worker is therefore also told its rank in the run's numbering
(``TRAINPERF_RANK``: node rank * N + local rank), which it uses instead of the kvstore's: global
rank 0, which writes the run's events, is then on node 0 (``comm.py``).

The launcher exits with the first failing worker's code, or 0. When a worker fails, the others
(waiting on it forever in a push or pull) and the scheduler and server are stopped; when all
workers have finished, so are the scheduler and server. SIGTERM stops everything.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from dataclasses import dataclass

from ..base import Cluster
from ..spawn import Members, add_output_args, local_cluster, read_cluster, run_supervised

WORKER_MODULE = "trainperf.backends.mxnet.worker"
KVSTORES = ("local", "device", "dist_sync")
SERVER_LINGER_S = 2.0
"""Several nodes: how long this node's server and scheduler outlive its workers. A worker
leaves as soon as it has the answer to the run's last barrier, which a worker on another node
may still be waiting to receive from this node's server."""


@dataclass(frozen=True)
class Process:
    """One process to start: its command and what it adds to the launcher's environment."""

    argv: list[str]
    env: dict[str, str]
    rank: int = -1
    """A worker's global rank; -1 for a helper."""
    helper: str = ""
    """A scheduler or server (``scheduler``, ``server on node 1``): serves the workers and is
    stopped when they are done. Empty for a worker."""

    @property
    def role(self) -> str:
        return self.env.get("DMLC_ROLE", "worker")


def is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def dmlc_env(role: str, cluster: Cluster) -> dict[str, str]:
    root, port = cluster.master
    here = cluster.addrs[cluster.node_rank]
    env = {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": root, "DMLC_PS_ROOT_PORT": str(port),
           "DMLC_NUM_SERVER": str(cluster.nnodes), "DMLC_NUM_WORKER": str(cluster.world_size),
           "DMLC_NODE_HOST": here}
    # ps-lite reads DMLC_INTERFACE only where DMLC_NODE_HOST is unset. Naming lo anywhere but
    # on loopback would point a ps-lite that does look it up at an unreachable interface.
    if is_loopback(here):
        env["DMLC_INTERFACE"] = "lo"
    return env


def plan(nproc: int, kvstore: str, worker_args: list[str], cluster: Cluster | None = None,
         module: str = WORKER_MODULE, python: str | None = None) -> list[Process]:
    """The processes this node starts for the run (``dist_sync`` without ``cluster``: one node
    over loopback, with ports found free now)."""
    python = python or sys.executable
    worker_cmd = [python, "-m", module, *worker_args]
    if kvstore != "dist_sync":
        if cluster is not None and cluster.nnodes > 1:
            raise ValueError(f"kvstore {kvstore} runs on one node; several nodes take dist_sync")
        return [Process(worker_cmd, {"TRAINPERF_KVSTORE": kvstore,
                                     "TRAINPERF_CONTEXTS": str(nproc),
                                     "TRAINPERF_LOCAL_RANK": "0"}, rank=0)]
    cluster = cluster or local_cluster(nproc)
    # The scheduler and server only route and sum: one thread each leaves the cores to workers.
    quiet = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}
    roles = ("scheduler", "server") if cluster.node_rank == 0 else ("server",)
    names = {"scheduler": "scheduler", "server": f"server on node {cluster.node_rank}"}
    helpers = [Process([python, "-c", "import mxnet"], dict(quiet, **dmlc_env(role, cluster)),
                       helper=names[role]) for role in roles]
    workers = [Process(worker_cmd, dict(
        dmlc_env("worker", cluster), TRAINPERF_KVSTORE="dist_sync", TRAINPERF_CONTEXTS="1",
        TRAINPERF_LOCAL_RANK=str(r), TRAINPERF_RANK=str(cluster.global_rank(r))),
        rank=cluster.global_rank(r)) for r in range(nproc)]
    return helpers + workers


def start_all(members: Members, nproc: int, kvstore: str, worker_args: list[str],
              module: str = WORKER_MODULE, cluster: Cluster | None = None) -> None:
    """Start the processes of the run: the workers, and the scheduler and server."""
    for p in plan(nproc, kvstore, worker_args, cluster, module):
        members.start(p.argv, dict(os.environ, **p.env), p.rank, p.helper)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True,
                        help="ranks on this node (contexts for device)")
    parser.add_argument("--kvstore", choices=KVSTORES, required=True)
    parser.add_argument("--cluster", default=None,
                        help="JSON of every node of the run (base.Cluster); none: this node")
    parser.add_argument("--module", default=WORKER_MODULE, help="the worker's module (tests)")
    add_output_args(parser)
    parser.add_argument("worker_args", nargs=argparse.REMAINDER,
                        help="after --: the worker's arguments (--spec ... --events ...)")
    args = parser.parse_args(argv)
    worker_args = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    if args.kvstore == "local" and args.nproc != 1:
        parser.error("kvstore local runs one rank")
    cluster = None
    if args.cluster:
        try:
            cluster = read_cluster(args.cluster, args.nproc)
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--cluster {args.cluster}: {exc}")
        if cluster.nnodes > 1 and args.kvstore != "dist_sync":
            parser.error(f"kvstore {args.kvstore} runs on one node; several nodes take "
                         f"--mxnet-kvstore dist_sync")

    linger = SERVER_LINGER_S if cluster is not None and cluster.nnodes > 1 else 0.0
    return run_supervised(
        lambda members: start_all(members, args.nproc, args.kvstore, worker_args, args.module,
                                  cluster), Members(args.logs, args.events), linger)


if __name__ == "__main__":
    sys.exit(main())
