"""Starts the processes of one MXNet run and takes them all down together (stdlib only).

``python -m trainperf.backends.mxnet.launch --nproc N --kvstore KIND -- WORKER_ARGS...``

- ``local``: one worker process on one context.
- ``device``: one worker process with N contexts and kvstore ``device`` (how insightface's MXNet
  ArcFace and gluon-cv trained on one machine).
- ``dist_sync``: a scheduler, one server and N workers over loopback, each worker one rank.
  (``mxnet.tools.launch`` does this too, but it breaks on Python 3.11.)

The launcher exits with the first failing worker's code, or 0. When a worker fails, the others
(waiting on it forever in a push or pull) and the scheduler and server are stopped; when all
workers have finished, so are the scheduler and server. SIGTERM stops everything.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from ..spawn import free_ports, run_supervised

WORKER_MODULE = "trainperf.backends.mxnet.worker"
KVSTORES = ("local", "device", "dist_sync")
# After the workers have finished, the server and scheduler shut down on their own within a
# moment; past this they are stopped.
SHUTDOWN_GRACE_S = 10.0


def dmlc_env(role: str, port: int, workers: int) -> dict[str, str]:
    return {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": str(workers),
            "DMLC_NODE_HOST": "127.0.0.1", "DMLC_INTERFACE": "lo"}


def start_all(nproc: int, kvstore: str, worker_args: list[str], module: str = WORKER_MODULE
              ) -> tuple[list[subprocess.Popen], list[subprocess.Popen]]:
    """(workers, helpers): the processes of the run, helpers being the scheduler and server."""
    python = sys.executable
    worker_cmd = [python, "-m", module, *worker_args]
    base = dict(os.environ)
    if kvstore != "dist_sync":
        env = dict(base, TRAINPERF_KVSTORE=kvstore, TRAINPERF_CONTEXTS=str(nproc),
                   TRAINPERF_LOCAL_RANK="0")
        return [subprocess.Popen(worker_cmd, env=env)], []
    port = free_ports(1)[0]
    # The scheduler and server only route and sum: one thread each leaves the cores to workers.
    quiet = dict(base, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1")
    helpers = [subprocess.Popen([python, "-c", "import mxnet"],
                                env=dict(quiet, **dmlc_env(role, port, nproc)))
               for role in ("scheduler", "server")]
    workers = [subprocess.Popen(worker_cmd, env=dict(
        base, **dmlc_env("worker", port, nproc), TRAINPERF_KVSTORE="dist_sync",
        TRAINPERF_CONTEXTS="1", TRAINPERF_LOCAL_RANK=str(i))) for i in range(nproc)]
    return workers, helpers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="ranks (contexts for device)")
    parser.add_argument("--kvstore", choices=KVSTORES, required=True)
    parser.add_argument("--module", default=WORKER_MODULE, help="the worker's module (tests)")
    parser.add_argument("worker_args", nargs=argparse.REMAINDER,
                        help="after --: the worker's arguments (--spec ... --events ...)")
    args = parser.parse_args(argv)
    worker_args = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    if args.kvstore == "local" and args.nproc != 1:
        parser.error("kvstore local runs one rank")

    return run_supervised(
        lambda: start_all(args.nproc, args.kvstore, worker_args, args.module))


if __name__ == "__main__":
    sys.exit(main())
