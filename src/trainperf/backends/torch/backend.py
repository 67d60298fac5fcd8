"""The torch backend's launch: ``torch.distributed.run`` in trainperf's own interpreter (one
process on one node starts the worker directly)."""

from __future__ import annotations

from ..base import Backend, Launch, LaunchRequest

WORKER_MODULE = "trainperf.backends.torch.worker"


def launch(req: LaunchRequest) -> Launch:
    topo = req.topology
    if topo.nnodes == 1 and topo.devices_per_node == 1:
        # One process needs no launcher: torchrun would only add a second interpreter that
        # imports torch (seconds per run) to set these variables.
        return Launch([req.python, "-m", WORKER_MODULE, *req.worker_args],
                      {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_WORLD_SIZE": "1"})
    argv = [req.python, "-m", "torch.distributed.run",
            f"--nproc-per-node={topo.devices_per_node}"]
    if topo.nnodes == 1:
        argv.append("--standalone")
    else:
        # After a rendezvous the runner knows every node; the launch itself is then the same
        # as a hand-given one, with node 0's first free port as the master port.
        node_rank, (addr, port) = ((req.cluster.node_rank, req.cluster.master) if req.cluster
                                   else (topo.node_rank, (topo.master_addr, topo.master_port)))
        argv += [f"--nnodes={topo.nnodes}", f"--node-rank={node_rank}",
                 f"--master-addr={addr}", f"--master-port={port}"]
    return Launch(argv + ["-m", WORKER_MODULE, *req.worker_args])


BACKEND = Backend(name="torch", framework="pytorch", launch=launch, hand_ranks=True,
                  trains=True)
