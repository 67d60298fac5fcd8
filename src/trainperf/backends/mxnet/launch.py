"""Starts the processes of one MXNet run on this node and takes them all down together (stdlib
only).

``python -m trainperf.backends.mxnet.launch --nproc N --kvstore KIND [--cluster PATH] [--logs DIR]
[--events FILE] -- ARGS...`` (``--logs``/``--events``: as ``trainperf.backends.spawn``'s, the
scheduler's and servers' output and exits included)

- ``local``: one worker process on one context.
- ``device``: one worker process with N contexts and kvstore ``device`` (how insightface's MXNet
  ArcFace and gluon-cv trained on one machine).
- ``horovod``: N workers on this node, each one rank whose collectives are Horovod's, told who
  it is as ``horovodrun --gloo`` tells it (``HOROVOD_RANK``, ``_SIZE``, ``_LOCAL_*``,
  ``_CROSS_*``, ``_HOSTNAME``, the gloo controller and CPU operations, the rendezvous address
  and the network interface). Node 0's launcher hosts the gloo rendezvous, Horovod's own HTTP
  server, in a helper process beside its workers (``rendezvous.py``), on node 0's first port,
  told every node's slots as ``horovodrun`` tells it; the workers meet there once, in
  ``hvd.init()``. Each node names itself by its address in the cluster (``HOROVOD_HOSTNAME``):
  every node knows every other's, and they differ. Several nodes: ``--cluster`` (a
  ``base.Cluster`` as JSON). Horovod 0.28.1's collectives themselves run on the address the
  host's name resolves to, whatever interface it is told (``horovod_host_refusal``): a node
  whose name resolves to loopback is refused in one line before anything starts.
- ``dist_sync``: N workers on this node, each one rank, and a parameter server; the scheduler
  runs on the first node only. One node: all over loopback. Several nodes (``--cluster``): the
  scheduler listens on node 0's first port, every node runs one server (``DMLC_NUM_SERVER`` =
  nodes) and its N workers (``DMLC_NUM_WORKER`` = every node's). (``mxnet.tools.launch`` does
  this too, but it breaks on Python 3.11.) Every gradient goes through the servers' processes
  (on the CPU): on many GPUs that is what it measures.

Each worker of ``local``, ``horovod`` and ``dist_sync`` sees its own GPU only
(``CUDA_VISIBLE_DEVICES``: the local rank's entry of the list the launcher was given, or the
local rank itself): MXNet puts a CUDA context, for its pinned host buffers, on the first GPU it
sees, which would otherwise be GPU 0 in every process. The scheduler and servers see none.

ps-lite numbers the workers itself, in an order of its own (it sorts them by host and port), not
by node. Each worker is therefore also told its rank in the run's numbering
(``TRAINPERF_RANK``: node rank * N + local rank), which it uses instead of the kvstore's: global
rank 0, which writes the run's events, is then on node 0 (``comm.py``). Horovod's rank is that
numbering already.

The launcher exits with the first failing worker's code, or 0. When a worker fails, the others
(waiting on it forever in a push or pull) and the scheduler and server are stopped; when all
workers have finished, so are the scheduler and server. SIGTERM stops everything.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass
from typing import Callable

from ..base import COLLECTIVE_TIMEOUT_ENV, Cluster, rank_gpu
from ..spawn import (Members, add_output_args, is_loopback, local_cluster, read_cluster,
                     run_supervised)
from ..spawn import interface_of as spawn_interface_of

WORKER_MODULE = "trainperf.backends.mxnet.worker"
KVSTORES = ("local", "device", "dist_sync", "horovod")
SEVERAL_NODES = ("dist_sync", "horovod")
"""The layouts that span nodes."""
RENDEZVOUS_MODULE = "trainperf.backends.mxnet.rendezvous"
RENDEZVOUS = "gloo rendezvous"
"""The helper that serves Horovod's rendezvous on node 0 (its log: ``gloo-rendezvous.log``)."""
GLOO_TIMEOUT_S = 1800
"""Seconds a Horovod rank waits in gloo (the rendezvous, a peer's part of a collective) before it
gives up, unless the runner says (``COLLECTIVE_TIMEOUT_ENV``): as torch's default, long enough
that a rank stopped in a debugger or by SIGSTOP is the runner's to name, not gloo's."""
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
        return self.env.get("DMLC_ROLE") or self.helper or "worker"


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


def own_gpu(local_rank: int, visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the worker of ``local_rank``: its entry of the launcher's
    own list (``base.rank_gpu``, which every one-GPU-per-process backend uses)."""
    return rank_gpu(local_rank, visible)


def interface_of(addr: str) -> str:
    """The network interface that holds ``addr`` (gloo's device is named by interface): ``lo``
    for a loopback address, else the interface whose IPv4 address it is. ValueError if none."""
    iface = spawn_interface_of(addr)
    if iface is None:
        raise ValueError(f"no network interface of this node holds {addr} (the node's address "
                         f"in the cluster); set HOROVOD_GLOO_IFACE to the one to use")
    return iface


def gloo_host_address(name: str | None = None) -> str | None:
    """Where gloo puts a device it is given no interface for: the first address of the host's
    name (``gethostname``) that a socket can bind, as ``gloo/transport/tcp/device.cc`` picks it;
    None where the name resolves to nothing bindable."""
    try:
        found = socket.getaddrinfo(name or socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, kind, proto, _, addr in found:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(addr)
        except OSError:
            continue
        return str(addr[0])
    return None


def horovod_host_refusal(cluster: Cluster, bound: Callable[[], str | None] = gloo_host_address
                         ) -> str | None:
    """Why Horovod's collectives cannot reach the other nodes from this one, or None.
    Horovod 0.28.1 (its last release) gives ``HOROVOD_GLOO_IFACE`` to the gloo device of its
    first contexts only: every process set's device, the default one's included, which carries
    every collective, is made with no interface (``GlooContext::InitializeForProcessSet``
    reads its own ``gloo_iface_``, never set), so gloo binds it to the host name's address. On
    a node whose name resolves to loopback (``127.0.1.1`` in Debian's /etc/hosts; an emulated
    node's shared name) each rank then tells the others an address they cannot reach, and
    ``hvd.init()`` fails after its first contexts have formed (a rank aborts in gloo, its peers
    wait). ``bound``: where gloo would bind (tests)."""
    here = cluster.addrs[cluster.node_rank]
    if cluster.nnodes < 2 or is_loopback(here):
        return None
    address = bound()
    if address is not None and not is_loopback(address):
        return None
    where = (f"resolves to {address}, which the other nodes cannot reach" if address else
             "resolves to no address a socket can bind")
    return (f"Horovod 0.28.1 runs its gloo collectives on the address of this host's name, "
            f"whatever HOROVOD_GLOO_IFACE says, and {socket.gethostname()!r} {where}: make the "
            f"name resolve to this node's address ({here}), or use --mxnet-kvstore dist_sync")


def slots(cluster: Cluster) -> list[dict[str, object]]:
    """Every rank of the run as ``horovodrun`` describes it to its rendezvous server
    (``SlotInfo``'s fields), each node named by its address."""
    n, size = cluster.nproc_per_node, cluster.world_size
    return [{"hostname": addr, "rank": node * n + r, "local_rank": r, "cross_rank": node,
             "size": size, "local_size": n, "cross_size": cluster.nnodes}
            for node, addr in enumerate(cluster.addrs) for r in range(n)]


def horovod_env(local_rank: int, cluster: Cluster, iface: str) -> dict[str, str]:
    """What ``hvd.init()`` reads in the worker of ``local_rank`` (``horovodrun --gloo``'s
    variables)."""
    addr, port = cluster.master
    slot = slots(cluster)[cluster.global_rank(local_rank)]
    timeout = os.environ.get(COLLECTIVE_TIMEOUT_ENV) or str(GLOO_TIMEOUT_S)
    return {"HOROVOD_RANK": str(slot["rank"]), "HOROVOD_SIZE": str(slot["size"]),
            "HOROVOD_LOCAL_RANK": str(slot["local_rank"]),
            "HOROVOD_LOCAL_SIZE": str(slot["local_size"]),
            "HOROVOD_CROSS_RANK": str(slot["cross_rank"]),
            "HOROVOD_CROSS_SIZE": str(slot["cross_size"]),
            "HOROVOD_HOSTNAME": str(slot["hostname"]),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_GLOO_IFACE": iface, "NCCL_SOCKET_IFNAME": iface,
            "HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(float(timeout)))}


def plan(nproc: int, kvstore: str, worker_args: list[str], cluster: Cluster | None = None,
         module: str = WORKER_MODULE, python: str | None = None, visible: str | None = None,
         iface: str | None = None) -> list[Process]:
    """The processes this node starts for the run (``dist_sync`` and ``horovod`` without
    ``cluster``: one node over loopback, with ports found free now). ``visible``: the
    launcher's ``CUDA_VISIBLE_DEVICES`` (None: unset); ``iface``: the interface Horovod's
    gloo uses (None: the one holding this node's address)."""
    python = python or sys.executable
    worker_cmd = [python, "-m", module, *worker_args]
    if kvstore not in SEVERAL_NODES:
        if cluster is not None and cluster.nnodes > 1:
            raise ValueError(f"kvstore {kvstore} runs on one node; several nodes take "
                             f"{' or '.join(SEVERAL_NODES)}")
        env = {"TRAINPERF_KVSTORE": kvstore, "TRAINPERF_CONTEXTS": str(nproc),
               "TRAINPERF_LOCAL_RANK": "0"}
        if kvstore == "local":
            env["CUDA_VISIBLE_DEVICES"] = own_gpu(0, visible)
        return [Process(worker_cmd, env, rank=0)]
    cluster = cluster or local_cluster(nproc)

    def worker(r: int, env: dict[str, str]) -> Process:
        rank = cluster.global_rank(r)
        return Process(worker_cmd, dict(
            env, TRAINPERF_KVSTORE=kvstore, TRAINPERF_CONTEXTS="1", TRAINPERF_LOCAL_RANK=str(r),
            TRAINPERF_RANK=str(rank), CUDA_VISIBLE_DEVICES=own_gpu(r, visible)), rank=rank)

    # The helpers only route, sum or answer: one thread each leaves the cores to workers.
    quiet = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if kvstore == "horovod":
        iface = iface or os.environ.get("HOROVOD_GLOO_IFACE") or interface_of(
            cluster.addrs[cluster.node_rank])
        rendezvous = [Process([python, "-m", RENDEZVOUS_MODULE, cluster.to_json()], quiet,
                              helper=RENDEZVOUS)] if cluster.node_rank == 0 else []
        return rendezvous + [worker(r, horovod_env(r, cluster, iface)) for r in range(nproc)]
    roles = ("scheduler", "server") if cluster.node_rank == 0 else ("server",)
    names = {"scheduler": "scheduler", "server": f"server on node {cluster.node_rank}"}
    helpers = [Process([python, "-c", "import mxnet"], dict(quiet, **dmlc_env(role, cluster)),
                       helper=names[role]) for role in roles]
    return helpers + [worker(r, dmlc_env("worker", cluster)) for r in range(nproc)]


def start_all(members: Members, nproc: int, kvstore: str, worker_args: list[str],
              module: str = WORKER_MODULE, cluster: Cluster | None = None) -> None:
    """Start the processes of the run: the workers, and their helpers (the scheduler and
    server, or node 0's rendezvous)."""
    try:
        why = horovod_host_refusal(cluster) if kvstore == "horovod" and cluster else None
        if why:
            raise ValueError(why)
        processes = plan(nproc, kvstore, worker_args, cluster, module,
                         visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ValueError as exc:  # the node cannot reach the others as asked: said in one line
        raise SystemExit(f"trainperf.backends.mxnet.launch: {exc}") from None
    for p in processes:
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
        if cluster.nnodes > 1 and args.kvstore not in SEVERAL_NODES:
            parser.error(f"kvstore {args.kvstore} runs on one node; several nodes take "
                         f"--mxnet-kvstore {' or '.join(SEVERAL_NODES)}")

    linger = SERVER_LINGER_S if cluster is not None and cluster.nnodes > 1 else 0.0
    return run_supervised(
        lambda members: start_all(members, args.nproc, args.kvstore, worker_args, args.module,
                                  cluster), Members(args.logs, args.events), linger)


if __name__ == "__main__":
    sys.exit(main())
