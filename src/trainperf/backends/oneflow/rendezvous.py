"""Keep OneFlow's start-up rendezvous from backing off (stdlib only: it runs before OneFlow is
imported).

Importing OneFlow joins the process group: rank 0 serves the rendezvous at ``MASTER_PORT`` and
every other rank connects to it. A rank that tries before rank 0 listens is refused, and
OneFlow 0.9 then waits before trying again, longer each time: when rank 0's import is slower
than another rank's (a loaded machine), the group forms seconds after the last rank is ready
(measured: 11.3 s for an import of 1.6 s, rank 1 started 3 s before rank 0). So a rank other
than 0 first waits, with a plain TCP connect every few milliseconds, until rank 0's port
accepts, and only then imports OneFlow.
"""

from __future__ import annotations

import os
import socket
import time

POLL_S = 0.02
GIVE_UP_S = 600.0
"""Past this the rank imports OneFlow anyway and lets OneFlow's own timeout decide (a rank 0
that died is stopped, with its peers, by the launcher long before)."""


def wait_for_rank0(environ: dict[str, str] | None = None) -> float:
    """Block until ``MASTER_ADDR:MASTER_PORT`` accepts a connection, on ranks other than 0 of
    a multi-rank run; returns the seconds waited (0 where there is nothing to wait for)."""
    env = os.environ if environ is None else environ
    if int(env.get("WORLD_SIZE", "1")) < 2 or int(env.get("RANK", "0")) == 0:
        return 0.0
    address = (env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]))
    start = time.monotonic()
    while time.monotonic() - start < GIVE_UP_S:
        try:
            with socket.create_connection(address, timeout=1.0):
                break
        except OSError:
            time.sleep(POLL_S)
    return time.monotonic() - start
