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
        argv += [f"--nnodes={topo.nnodes}", f"--node-rank={topo.node_rank}",
                 f"--master-addr={topo.master_addr}", f"--master-port={topo.master_port}"]
    return Launch(argv + ["-m", WORKER_MODULE, *req.worker_args])


BACKEND = Backend(name="torch", framework="pytorch", launch=launch)
