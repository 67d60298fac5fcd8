"""The ports a run listens on (``trainperf.backends.ports``) and what the runner does when one was
taken anyway (``outcome.with_port_retry``; each backend's run shows the whole retry in its own
test file: ``test_a_launch_whose_ports_were_taken_starts_again``)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from trainperf.backends import ports
from trainperf.outcome import Outcome, agree, names_bind_failure, with_port_retry
from trainperf.protocol import Error, Step


class FirstThese:
    """A random source that draws the given ports first (where they lie in the band), then
    anything."""

    def __init__(self, *first: int) -> None:
        self.first = list(first)

    def randrange(self, n: int) -> int:
        while self.first:
            port = self.first.pop(0)
            for band in ports.bands(ports.ephemeral_range()):
                if len(band) == n and port in band:
                    return band.index(port)
        return int(time.perf_counter_ns() % n)


def test_reserved_ports_lie_outside_the_kernels_range_and_bind():
    lo, hi = ports.ephemeral_range()
    with ports.reserve(8) as held:
        assert len(set(held.ports)) == 8
        assert all(not lo <= p <= hi and p >= ports.LOWEST for p in held.ports)
        for p in held.ports:  # nothing holds them: the run's processes can bind them
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))


def test_the_range_is_read_from_the_kernel(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(path)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == ports.DEFAULT_EPHEMERAL
    assert ports.bands((40000, 50000)) == [range(50001, 65536), range(10000, 40000)]
    assert ports.bands((1024, 65535)) == []


def test_a_host_that_gives_the_kernel_every_port_still_gets_distinct_claimed_ports(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    with ports.reserve(4) as held:
        assert len(set(held.ports)) == 4


def test_a_port_claimed_by_another_process_is_never_chosen():
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from trainperf.backends import ports; "
         "held = ports.reserve(1); print(held.ports[0], flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        theirs = int(holder.stdout.readline())
        with ports.reserve(3, rng=FirstThese(theirs, theirs)) as mine:
            assert theirs not in mine.ports
    finally:
        holder.kill()
        holder.wait()
    # Claims go with the process that held them, however it ended.
    with ports.reserve(1, rng=FirstThese(theirs)) as mine:
        assert mine.ports == (theirs,)


def test_a_port_another_socket_is_bound_to_is_never_chosen():
    with ports.reserve(1) as first:
        port = first.ports[0]
    with socket.socket() as thief:
        thief.bind(("0.0.0.0", port))  # bound, not even listening
        with ports.reserve(2, rng=FirstThese(port, port)) as held:
            assert port not in held.ports
    with ports.reserve(1, rng=FirstThese(port)) as held:
        assert held.ports == (port,)


def test_taken_tells_a_live_socket_from_a_closed_connection():
    with ports.reserve(2) as held:
        busy, closed = held.ports
    # A connection the run's own listener accepted and closed first lingers in TIME_WAIT on
    # its port: not a taken port.
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", closed))
        server.listen()
        client = socket.create_connection(("127.0.0.1", closed))
        conn, _ = server.accept()
        conn.close()
        client.close()
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", busy))
        assert ports.taken([busy, closed]) == [busy]
    assert ports.taken([busy, closed]) == []


def error(message: str, rank: int = 0) -> Error:
    return Error(kind="exception", message=message, rank=rank)


def test_a_run_that_lost_a_port_before_its_first_step_starts_again():
    failed = Outcome("failed", "rank 0 died of SIGABRT (signal 6) before the first step", True)
    got = with_port_retry(failed, [], lambda: [61001])
    assert got.retry == "port 61001 taken by another process before the run's own could bind"
    assert (got.status, got.error) == (failed.status, failed.error)
    # Only the words of a process of the run, where the port was freed again since.
    said = [error("DistNetworkError: ... code: -98, name: EADDRINUSE, message: address already "
                  "in use")]
    assert with_port_retry(Outcome("failed", said[0].message, True), said, list).retry == (
        "a process of the run could not bind its port")
    # Anything else is the run's own failure, asked about only when it could be a port.
    asked = []
    assert with_port_retry(failed, [], lambda: asked.append(1) or []).retry is None
    assert asked == [1]
    step = Step(index=0, seconds=0.1, samples=8, warmup=True)
    for here, events in ((failed, [step]), (Outcome("ok", None), []),
                         (Outcome("oom", "out of memory", True), [])):
        assert with_port_retry(here, events, lambda: pytest.fail("asked")).retry is None


def test_the_frameworks_words_for_a_failed_bind():
    for text in ("MXNetError: Check failed: my_node_.port != -1 (-1 vs. -1) : bind failed",
                 "JaxRuntimeError: UNKNOWN: Failed to start RPC server",
                 "UnknownError: Could not start gRPC server",
                 "RuntimeError: ... name: EADDRINUSE, message: address already in use"):
        assert names_bind_failure(text), text
    assert not names_bind_failure("RuntimeError: Connection reset by peer")


def test_every_node_starts_again_only_when_a_lost_port_is_the_only_cause():
    lost = {"status": "failed", "error": "port 61001 taken ...", "cause": True,
            "retry": "port 61001 taken by another process before the run's own could bind"}
    peer = Outcome("failed", "RuntimeError: Connection closed by peer", False)
    assert agree(0, peer, {1: lost}, 2, 10).retry == lost["retry"]
    crashed = Outcome("failed", "rank 0 died of SIGSEGV (signal 11) at step 3", True)
    assert agree(0, crashed, {1: lost}, 2, 10).retry is None
    assert agree(0, peer, {}, 2, 10).retry is None  # a node that told nothing
