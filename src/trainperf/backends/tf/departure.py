"""Where TensorFlow's ranks leave together (standard library only: tested without
TensorFlow).

A rank's collective returns once the rank has what it needs, which it takes from its peers'
gRPC servers: in the RING all-reduce a rank pulls each piece from the rank that holds it
(``RecvBuf``). A rank past the run's last barrier that leaves (the worker ends with
``os._exit``) takes its server with it while a peer may still be pulling that barrier's last
piece from it: the peer's barrier then fails, after the run's ``end``, with ``UNAVAILABLE:
Socket closed`` from the gone rank. Seen on two emulated nodes (one network namespace and one
core each) in 2 of 7 runs of 3 steps.

So no rank leaves before every rank is past the last barrier. Each other rank tells rank 0 so
over a plain socket (``DEPARTURE_ENV``: on node 0, a port of the run that no rank listens on
otherwise) and waits for its word; rank 0 gives the word once all have told it. Rank 0 listens
from before its first collective (no rank can be past the last one before rank 0 takes part in
it), and its word is a few bytes the kernel delivers after rank 0 has gone: nothing waits on a
process that has left.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field

from .backend import DEPARTURE_ENV

WAIT_S = 60.0
"""How long a rank waits for the others (rank 0) or for rank 0's word (the others). A rank that
died is stopped, with its peers, by the launcher well before (``spawn.PEER_GRACE_S``)."""
CONNECT_TRIES = 5
POLL_S = 0.02
WORD = b"go\n"


def split_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6 address]:port`` -> (host, port)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass
class Departure:
    """Made before the run's first collective; ``leave_together`` after its last barrier.
    Without the variable, or on one rank, it does nothing."""

    rank: int
    world_size: int
    address: tuple[str, int] | None
    listener: socket.socket | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Departure":
        """This rank's, from ``TF_CONFIG`` (the task index is the rank) and
        ``DEPARTURE_ENV``; rank 0 starts listening now."""
        env = os.environ if environ is None else environ
        config = json.loads(env.get("TF_CONFIG") or "{}")
        world = max(1, len(config.get("cluster", {}).get("worker", [])))
        rank = int(config.get("task", {}).get("index", 0))
        where = env.get(DEPARTURE_ENV)
        departure = cls(rank, world, split_endpoint(where) if where and world > 1 else None)
        if departure.address is not None and rank == 0:
            family = socket.AF_INET6 if ":" in departure.address[0] else socket.AF_INET
            departure.listener = socket.create_server(departure.address, family=family,
                                                      backlog=world)
        return departure

    def leave_together(self, wait_s: float = WAIT_S) -> list[int]:
        """Return once every rank is past the last barrier, or after ``wait_s``: the ranks
        that were never heard from (on rank 0, those that never said so; on another rank,
        ``[0]`` where rank 0's word never came)."""
        if self.address is None:
            return []
        if self.rank != 0:
            return [] if self._tell_and_wait(wait_s) else [0]
        assert self.listener is not None
        told: dict[int, socket.socket] = {}
        deadline = time.monotonic() + wait_s
        with self.listener:
            while len(told) < self.world_size - 1 and (left := deadline - time.monotonic()) > 0:
                self.listener.settimeout(left)
                try:
                    conn, _ = self.listener.accept()
                except OSError:  # the deadline (socket.timeout is an OSError)
                    break
                conn.settimeout(max(deadline - time.monotonic(), 0.1))
                try:
                    said = conn.recv(64).decode("ascii", "replace").strip()
                except OSError:
                    said = ""
                if said.isdigit() and int(said) not in told:
                    told[int(said)] = conn
                else:
                    conn.close()
        for conn in told.values():
            with conn:
                try:
                    conn.sendall(WORD)
                except OSError:
                    pass  # that rank gave up waiting and left: nothing to protect there
        return sorted(set(range(1, self.world_size)) - set(told))

    def _tell_and_wait(self, wait_s: float) -> bool:
        """Say this rank is past the last barrier, then wait for rank 0's word: whether it
        came. Rank 0 listened before its first collective, so a refused connection means it has
        gone, and there is nothing left to wait for."""
        assert self.address is not None
        for _ in range(CONNECT_TRIES):
            try:
                conn = socket.create_connection(self.address, timeout=5.0)
            except OSError:
                time.sleep(POLL_S)
                continue
            with conn:
                try:
                    conn.sendall(f"{self.rank}\n".encode("ascii"))
                    conn.settimeout(wait_s)
                    heard = b""
                    while len(heard) < len(WORD):
                        more = conn.recv(len(WORD) - len(heard))
                        if not more:
                            break  # rank 0 left without a word: it failed after the barrier
                        heard += more
                    return heard == WORD
                except OSError:
                    return False
        return False
