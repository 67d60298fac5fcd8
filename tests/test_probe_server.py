"""The link-probe server every node runs for the length of a run (``rendezvous.ProbeServer``):
it answers probes, and what it reads and whom it serves are bounded, since it listens on the
node's address."""

from __future__ import annotations

import socket
import time

from trainperf import rendezvous
from trainperf.rendezvous import PROBE_HEADER, ProbeLink, ProbeServer


def closed_by_peer(sock: socket.socket, within_s: float = 10.0) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_probes_are_answered_and_a_length_beyond_any_probe_is_not_read():
    server = ProbeServer("127.0.0.1")
    try:
        link = ProbeLink("127.0.0.1", server.port, 10.0)
        assert link.measure(bytes(1 << 20)) > 0
        # A client-sent length of 1 TiB: the server closes the connection, reading nothing.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(PROBE_HEADER.pack(1 << 40))
            assert closed_by_peer(sock)
        assert link.measure(bytes(1024)) > 0  # the prober's own connection goes on
    finally:
        server.close()


def test_connections_beyond_the_bound_are_closed_as_they_come():
    server = ProbeServer("127.0.0.1")
    held = []
    try:
        for _ in range(rendezvous.PROBE_MAX_CONNECTIONS):
            held.append(socket.create_connection(("127.0.0.1", server.port)))
        time.sleep(0.2)  # each is being served by then
        with socket.create_connection(("127.0.0.1", server.port)) as extra:
            assert closed_by_peer(extra)
        for sock in held[:2]:
            sock.close()
        # Slots freed by probers that left serve the next ones.
        deadline = time.monotonic() + 10
        while True:
            link = ProbeLink("127.0.0.1", server.port, 5.0)
            if link.measure(bytes(1024)) is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert link.measure(bytes(1024)) > 0
    finally:
        for sock in held:
            sock.close()
        server.close()
