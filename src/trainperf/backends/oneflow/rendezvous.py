"""Where OneFlow's ranks meet outside OneFlow: at the start, so that its rendezvous does not back
off, and at the end, so that rank 0 leaves last (stdlib only: the first runs before OneFlow is
imported).

**The start.** Importing OneFlow joins the process group: rank 0 serves the rendezvous at
``MASTER_PORT`` and every other rank connects to it. A rank that tries before rank 0 listens is
refused, and OneFlow 0.9 then waits before trying again, longer each time: when rank 0's import
is slower than another rank's (a loaded machine), the group forms seconds after the last rank is
ready (measured: 11.3 s for an import of 1.6 s, rank 1 started 3 s before rank 0). So a rank
other than 0 first waits, with a plain TCP connect every few milliseconds, until rank 0's port
accepts, and only then imports OneFlow.

**The end.** Rank 0 serves OneFlow's control plane, and ``flow.comm.barrier`` is a request to it
that the other ranks wait on. Rank 0's own call returns as soon as the last rank has arrived,
while its answers to the others may still be on their way; a rank 0 that then leaves (the worker
ends with ``os._exit``) fails their request, and OneFlow aborts them (``Check failed`` in
``RpcClient::Barrier``, SIGABRT after the last step). Measured with a bare barrier and
``os._exit`` on 2 CPU ranks: a rank aborted in 5 of 150 rounds, and in none of 150 with the
handshake below (``benchmarks/results/oneflow-teardown-2026-11-28``). So every other rank,
once past the last barrier, tells rank 0 so over a plain socket (``TRAINPERF_DEPARTURE_PORT``
on node 0), and rank 0 leaves only when all have: a rank's message needs no answer, so nothing
waits on a process that has gone.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

from .backend import PORT_VARIABLE

POLL_S = 0.02
GIVE_UP_S = 600.0
"""Past this the rank imports OneFlow anyway and lets OneFlow's own timeout decide (a rank 0
that died is stopped, with its peers, by the launcher long before)."""


def _group(environ: dict[str, str] | None) -> tuple[dict[str, str], int, int, str]:
    """The launcher's variables (``os.environ`` by default), the world size, this rank and rank
    0's address."""
    env = os.environ if environ is None else environ
    return (env, int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0")),
            env.get("MASTER_ADDR", "127.0.0.1"))


def wait_for_rank0(environ: dict[str, str] | None = None) -> float:
    """Block until ``MASTER_ADDR:MASTER_PORT`` accepts a connection, on ranks other than 0 of
    a multi-rank run; returns the seconds waited (0 where there is nothing to wait for)."""
    env, world, rank, master = _group(environ)
    if world < 2 or rank == 0:
        return 0.0
    address = (master, int(env["MASTER_PORT"]))
    start = time.monotonic()
    while time.monotonic() - start < GIVE_UP_S:
        try:
            with socket.create_connection(address, timeout=1.0):
                break
        except OSError:
            time.sleep(POLL_S)
    return time.monotonic() - start


DEPART_WAIT_S = 60.0
"""How long rank 0 waits for the other ranks to say they are past the last barrier. A rank that
died after it is stopped, with rank 0, by the launcher well before (``spawn.PEER_GRACE_S``)."""
CONNECT_TRIES = 5


@dataclass
class Departure:
    """Rank 0 listens from the start of the run (before any rank can be done), the other ranks
    connect once, at the end. Without the variable, or on one rank, it does nothing."""

    rank: int
    world_size: int
    address: tuple[str, int] | None
    listener: socket.socket | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Departure":
        env, world, rank, master = _group(environ)
        port = env.get(PORT_VARIABLE)
        address = (master, int(port)) if port else None
        departure = cls(rank, world, address if world > 1 else None)
        if departure.address is not None and rank == 0:
            host = departure.address[0]
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            departure.listener = socket.create_server(departure.address, family=family,
                                                      backlog=world)
        return departure

    def leave_after_peers(self, wait_s: float = DEPART_WAIT_S) -> list[int]:
        """Call after the last barrier. Rank 0 returns once every other rank has said it is
        past it (or after ``wait_s``), with the ranks that never said so; the other ranks say
        so and return ``[]``."""
        if self.address is None:
            return []
        if self.rank != 0:
            self._tell_rank0()
            return []
        assert self.listener is not None
        waiting = set(range(1, self.world_size))
        deadline = time.monotonic() + wait_s
        with self.listener:
            while waiting and (left := deadline - time.monotonic()) > 0:
                self.listener.settimeout(left)
                try:
                    conn, _ = self.listener.accept()
                except OSError:  # the deadline (socket.timeout is an OSError)
                    break
                with conn:
                    conn.settimeout(max(deadline - time.monotonic(), 0.1))
                    try:
                        said = conn.recv(64).decode("ascii", "replace").strip()
                    except OSError:
                        continue
                if said.isdigit():
                    waiting.discard(int(said))
        return sorted(waiting)

    def _tell_rank0(self) -> None:
        """One line with this rank; nothing comes back. Rank 0 listened before the run began,
        so where a few tries are refused it has gone, and there is nothing left to protect."""
        assert self.address is not None
        for _ in range(CONNECT_TRIES):
            try:
                with socket.create_connection(self.address, timeout=5.0) as conn:
                    conn.sendall(f"{self.rank}\n".encode("ascii"))
                return
            except OSError:
                time.sleep(POLL_S)
