"""Starts the ranks of one run as one process each and takes them all down together (stdlib
only). Used by every backend whose framework has no launcher worth depending on.

``python -m trainperf.backends.spawn --backend NAME --nproc N -- WORKER_ARGS...``

Rank ``r`` runs ``python -m trainperf.backends.NAME.worker WORKER_ARGS`` with the variables that
``trainperf.backends.NAME.backend.rank_env(r, N, ports)`` gives (the framework's own way of
naming ranks and rendezvous points). The launcher exits with the first failing rank's code, or
0. When a rank fails, the others (waiting on it forever in a collective) are stopped after a
moment to write their own error; SIGTERM stops everything.
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

POLL_S = 0.1
PEER_GRACE_S = 2.0
"""A failing rank writes its error event before it exits; its peers may be mid-way through
writing theirs, so they get a moment before they are stopped."""
PORTS_PER_RUN = 4
"""Free loopback ports handed to ``rank_env`` (coordinator, one per rank for the frameworks
that give each rank an endpoint; a backend uses what it needs)."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (held open together so none is handed out twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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
              shutdown_grace_s: float = 10.0) -> int:
    """Wait for the run: the first failing worker's code (the rest stopped), or 0. Helpers
    (servers, schedulers) serve the workers: stopped when the workers are done, and a crashed
    helper fails the run, since the workers would wait on it forever."""
    helpers = list(helpers)
    while True:
        codes = [p.poll() for p in workers]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            stop(workers, PEER_GRACE_S)
            stop(helpers, 0.5)
            return failed[0]
        if all(c == 0 for c in codes):
            stop(helpers, shutdown_grace_s)
            return 0
        if any(h.poll() not in (None, 0) for h in helpers):
            stop(workers, PEER_GRACE_S)
            stop(helpers, 0.5)
            return 1
        time.sleep(POLL_S)


def run_supervised(start) -> int:
    """``start()`` -> (workers, helpers); supervise them, stopping all on SIGTERM (130)."""
    workers: list[subprocess.Popen] = []
    helpers: list[subprocess.Popen] = []

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        workers, helpers = start()
        return supervise(workers, helpers)
    except KeyboardInterrupt:
        stop(workers + helpers, 2.0)
        return 130


def worker_args_after_dashes(args: list[str]) -> list[str]:
    return args[1:] if args[:1] == ["--"] else args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True, help="backend folder name (paddle, jax...)")
    parser.add_argument("--nproc", type=int, required=True, help="ranks on this node")
    parser.add_argument("--module", default=None, help="the worker's module (tests)")
    parser.add_argument("worker_args", nargs=argparse.REMAINDER,
                        help="after --: the worker's arguments (--spec ... --events ...)")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    description = importlib.import_module(f"trainperf.backends.{args.backend}.backend")
    module = args.module or f"trainperf.backends.{args.backend}.worker"
    cmd = [sys.executable, "-m", module, *worker_args_after_dashes(args.worker_args)]

    def start():
        ports = free_ports(PORTS_PER_RUN + args.nproc)
        workers = [subprocess.Popen(cmd, env=dict(
            os.environ, TRAINPERF_LOCAL_RANK=str(r),
            **description.rank_env(r, args.nproc, ports))) for r in range(args.nproc)]
        return workers, []

    return run_supervised(start)


if __name__ == "__main__":
    sys.exit(main())
