"""Horovod's gloo rendezvous for one run: ``python -m trainperf.backends.mxnet.rendezvous
CLUSTER_JSON``, started by node 0's launcher (``launch.py``) beside its workers and stopped
with them.

It is the server ``horovodrun --gloo`` starts (``horovod.runner.http.http_server``'s
``RendezvousHTTPServer``), told every slot of the run as ``horovodrun`` tells it, so that each
scope (the global one, each node's, each local rank's across nodes) is cleared once its ranks
are done with it. ``horovodrun`` binds a port it finds free; this one binds node 0's first port
of the cluster, which every node knows before any starts. A taken port ends it at once, in words
the runner knows for a failed bind, and the runner starts the run again on fresh ports.
"""

from __future__ import annotations

import sys

from ..base import Cluster
from .launch import slots


def main(argv: list[str]) -> int:
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    cluster = Cluster.from_json(argv[0])
    addr, port = cluster.master
    try:
        server = RendezvousHTTPServer((addr, port), RendezvousHandler, 0)
    except OSError as exc:
        print(f"Horovod's gloo rendezvous could not bind {addr}:{port}: {exc}", file=sys.stderr)
        return 1
    server.init([SlotInfo(**slot) for slot in slots(cluster)])
    server.serve_forever()  # until the launcher stops it
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
