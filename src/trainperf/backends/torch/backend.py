"""The torch backend's launch: ``torch.distributed.run`` in trainperf's own interpreter."""

from __future__ import annotations

from ..base import Backend, Launch, LaunchRequest

WORKER_MODULE = "trainperf.backends.torch.worker"


def launch(req: LaunchRequest) -> Launch:
    topo = req.topology
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


BACKEND = Backend(name="torch", framework="pytorch", launch=launch, hand_ranks=True)
