"""Ports a run's processes will listen on, chosen so that nothing else is handed them before
they bind (standard library only).

A port found free by binding to port 0 and closing the socket can be lost before the rank,
scheduler, coordinator or store that needs it binds it, in two ways: the kernel hands it to
another socket as an ephemeral port (a gloo pair, a store client's connection, any program on the
host), or another launcher finds it free too. ``reserve`` closes both:

- It chooses outside the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``),
  where the kernel hands out nothing by itself; a port is chosen only if nothing on the host is
  bound to it now.
- It holds a claim on each chosen port for as long as the reservation lives: an abstract Unix
  socket named after the port, which no other process can bind while this one holds it, and
  which the kernel drops when the holder exits, however it exits. Abstract names live in a
  network namespace, as the ports do.

What can still take a port is a program that binds that very number by itself between the check
and the rank's bind. ``taken`` then tells which of a run's ports a live socket outside the run
holds (and ``outcome.names_bind_failure`` recognises the frameworks' words for a failed bind):
the runner starts such a run again on fresh ports and records that it did.
"""

from __future__ import annotations

import errno
import random
import socket
import sys

LOOPBACK = "127.0.0.1"
RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL = (32768, 60999)
"""Linux's default, where the range cannot be read."""
LOWEST = 10000
"""Ports below this are left alone: well-known services live there."""
TRIES_PER_PORT = 200
CLAIM_PREFIX = "trainperf-port-"

def ephemeral_range(path: str = RANGE_FILE) -> tuple[int, int]:
    """The ports the kernel hands out by itself, inclusive."""
    try:
        with open(path, encoding="ascii") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def bands(ephemeral: tuple[int, int]) -> list[range]:
    """Where ``reserve`` looks, best first: above the ephemeral range (MXNet's ps-lite draws its
    own retries from 10000-50000), then below it, down to ``LOWEST``."""
    lo, hi = ephemeral
    out = [range(max(hi + 1, LOWEST), 65536), range(LOWEST, min(lo, 65536))]
    return [r for r in out if len(r) > 0]


def _families(addr: str) -> list[tuple[int, str]]:
    """The wildcard addresses a check binds: a socket bound to a port on any address conflicts
    with the wildcard, and a framework may listen on either family's."""
    fams = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        fams.append((socket.AF_INET6, "::"))
    if ":" in addr:
        fams.reverse()
    return fams


def _bind_ok(port: int, addr: str, reuse: bool) -> bool:
    """Whether ``port`` binds now on every family's wildcard (with ``reuse``: SO_REUSEADDR,
    which a closing socket's TIME_WAIT does not block, but a live bound or listening one does)."""
    for family, wildcard in _families(addr):
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            if reuse:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((wildcard, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE or family == socket.AF_INET:
                return False
            # No IPv6 on this host (EADDRNOTAVAIL, EAFNOSUPPORT): nothing can hold it there.
        finally:
            s.close()
    return True


def _claim(port: int) -> socket.socket | None:
    """This process's claim on ``port`` among trainperf's processes; None if another holds it.
    Where abstract sockets do not exist (not Linux), every claim succeeds and the bind check
    alone guards."""
    if not sys.platform.startswith("linux"):
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a placeholder to close
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(f"\0{CLAIM_PREFIX}{port}")
    except OSError:
        s.close()
        return None
    return s


class Reservation:
    """Ports held for one run until ``release`` (or until this process exits)."""

    def __init__(self, ports: list[int], claims: list[socket.socket]) -> None:
        self.ports = tuple(ports)
        self._claims = claims

    def release(self) -> None:
        for s in self._claims:
            s.close()
        self._claims = []

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def reserve(n: int, addr: str = LOOPBACK, rng: random.Random | None = None) -> Reservation:
    """``n`` distinct ports that nothing is bound to now, outside the kernel's ephemeral range,
    each claimed for this process until the reservation is released. Where no band outside the
    range has room (a host that gives the kernel every port), ports the kernel finds free now,
    claimed all the same."""
    rng = rng or random.SystemRandom()
    ports: list[int] = []
    claims: list[socket.socket] = []
    try:
        for band in bands(ephemeral_range()):
            for _ in range(TRIES_PER_PORT * n):
                if len(ports) == n:
                    break
                port = band[rng.randrange(len(band))]
                if port in ports:
                    continue
                claim = _claim(port)
                if claim is None:
                    continue
                if _bind_ok(port, addr, reuse=False):
                    ports.append(port)
                    claims.append(claim)
                else:
                    claim.close()
        while len(ports) < n:
            port = _kernel_port(addr)
            claim = _claim(port) if port not in ports else None
            if claim is not None:
                ports.append(port)
                claims.append(claim)
    except BaseException:
        for s in claims:
            s.close()
        raise
    return Reservation(ports, claims)


def _kernel_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def taken(ports: tuple[int, ...] | list[int], addr: str = LOOPBACK) -> list[int]:
    """Which of ``ports`` a live socket holds now. Asked after a run's processes have ended:
    what holds a port then is outside the run (its own sockets' TIME_WAIT does not count)."""
    return [p for p in ports if not _bind_ok(p, addr, reuse=True)]
