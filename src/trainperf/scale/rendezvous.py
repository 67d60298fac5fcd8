"""Nodes of a multi-node plan meet through torch's c10d rendezvous instead of hand-given ranks.

Every node runs the same ``trainperf run ... --nnodes N --rdzv HOST:PORT``. The first time the
nodes meet, c10d's dynamic rendezvous gives each its node rank; the node whose address is HOST
hosts the store for as long as its runner lives. Before every run the nodes meet again on that
store under the run's name: each publishes ports it has just found free, so that every backend
can be told where every rank of the run listens (``Cluster``). A node that does not arrive within
the timeout, or whose store went away with its node, turns into ``RendezvousError``, which the
runner records as the run's failure.

Node ranks stay fixed for the life of the runners, so one node (rank 0) holds every measurement.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from ..backends.base import Cluster
from ..backends.spawn import free_ports

POLL_S = 0.1
DEFAULT_TIMEOUT_S = 300.0
_STORES: list[Any] = []
"""Every store this process opened, kept until it exits: a store this process hosts may
serve another plan's meetings (``--data`` runs two plans through one endpoint), and the other
nodes' last meetings, after this node's own plan is done."""


class RendezvousError(RuntimeError):
    """The nodes could not meet (a node missing, the store lost, plans that differ)."""


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ValueError with the flag's name."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv takes HOST:PORT (e.g. node001:29400), got {text!r}")
    return host, int(port)


def local_addr_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host``: the one the other nodes can reach it
    at, on clusters whose hostnames resolve to another network (or to nothing)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as exc:
        raise RendezvousError(f"cannot resolve the rendezvous host {host!r}: {exc}") from None
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)  # a datagram socket only picks the route; nothing is sent
        return s.getsockname()[0]


def is_local_address(addr: str) -> bool:
    """True when ``addr`` belongs to this machine (bindable), whatever the hostname says."""
    try:
        ip = ipaddress.ip_address(socket.getaddrinfo(addr, None)[0][4][0])
    except (socket.gaierror, ValueError):
        return False
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((str(ip), 0))
        except OSError:
            return False
    return True


def interface_of(addr: str) -> str | None:
    """The network interface that holds ``addr`` (for GLOO_SOCKET_IFNAME), or None."""
    for name, snics in psutil.net_if_addrs().items():
        if any(s.address.split("%")[0] == addr for s in snics):
            return name
    return None


def settings_digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class NodeGroup:
    """This node's place among the nodes of one plan."""

    endpoint: str
    nnodes: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    run_id: str = "trainperf"
    node_rank: int | None = None
    addrs: tuple[str, ...] = ()
    local_addr: str = ""
    _store: Any = field(default=None, repr=False)
    _handler: Any = field(default=None, repr=False)

    def join(self, settings: dict[str, Any]) -> None:
        """Meet the other nodes once: node rank, every node's address, and the check that all
        run the same plan."""
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.api import RendezvousError as TorchRdzvError
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousTimeoutError as TorchRdzvTimeout)
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            create_backend)
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler, RendezvousTimeout)

        # The keep-alive thread logs every failed beat once the hosting node has finished;
        # the runner reports what matters itself.
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        host, port = parse_endpoint(self.endpoint)
        self.local_addr = local_addr_towards(host, port)
        timeout = RendezvousTimeout(join=_delta(self.timeout_s), last_call=_delta(1.0),
                                    close=_delta(5.0))
        candidates = [True, False] if is_local_address(host) else [False]
        last: Exception | None = None
        for hosting in candidates:  # several nodes on one machine: one of them hosts
            params = RendezvousParameters(
                backend="c10d", endpoint=self.endpoint, run_id=self.run_id,
                min_nodes=self.nnodes, max_nodes=self.nnodes, local_addr=self.local_addr,
                is_host=hosting, read_timeout=int(max(60, self.timeout_s)))
            try:
                backend, store = create_backend(params)
                _STORES.append(store)
                break
            except (TorchRdzvError, RuntimeError, ValueError) as exc:
                last = exc
        else:
            raise RendezvousError(f"cannot reach the rendezvous at {self.endpoint}: "
                                  f"{_root(last)}")
        self._handler = DynamicRendezvousHandler.from_backend(
            self.run_id, store, backend, self.nnodes, self.nnodes, self.local_addr, timeout)
        started = time.monotonic()
        try:
            info = self._handler.next_rendezvous()
        except TorchRdzvTimeout:
            raise RendezvousError(
                f"the {self.nnodes} nodes did not all arrive at the rendezvous {self.endpoint} "
                f"within {time.monotonic() - started:.0f} s") from None
        except TorchRdzvError as exc:
            raise RendezvousError(f"the rendezvous at {self.endpoint} failed: "
                                  f"{_root(exc)}") from None
        self._store, self.node_rank = info.store, info.rank
        digest = settings_digest(settings)
        self._set(f"node/{self.node_rank}", json.dumps({"addr": self.local_addr,
                                                         "plan": digest}))
        nodes = [json.loads(v) for v in self._wait_all("node", "the first meeting")]
        differ = [r for r, n in enumerate(nodes) if n["plan"] != digest]
        if differ:
            raise RendezvousError(f"node(s) {differ} run another plan than node "
                                  f"{self.node_rank}: start every node with the same options")
        self.addrs = tuple(n["addr"] for n in nodes)

    def meet(self, label: str, nproc_per_node: int, nports: int) -> Cluster:
        """Meet again before run ``label``: every node's free ports for it."""
        if self._store is None or self.node_rank is None:
            raise RendezvousError("the nodes have not met yet")
        ports = free_ports(nports, self.local_addr)
        self._set(f"run/{label}/{self.node_rank}", json.dumps(ports))
        found = [json.loads(v) for v in self._wait_all(f"run/{label}", label)]
        return Cluster(self.node_rank, nproc_per_node, self.addrs,
                       tuple(tuple(p) for p in found))

    def close(self) -> None:
        handler, self._handler, self._store = self._handler, None, None
        if handler is not None:
            try:
                handler.shutdown()
            except Exception:  # the hosting node may be gone already; nothing is left to tell
                pass

    # -- the store --------------------------------------------------------------------------
    def _set(self, key: str, value: str) -> None:
        try:
            self._store.set(key, value)
        except Exception as exc:
            raise self._lost(exc) from None

    def _wait_all(self, prefix: str, what: str) -> list[str]:
        """The value every node wrote under ``prefix/<rank>``, waiting at most the timeout."""
        keys = [f"{prefix}/{r}" for r in range(self.nnodes)]
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                present = [k for k in keys if self._store.check([k])]
                if len(present) == len(keys):
                    return [self._store.get(k).decode() for k in keys]
                if time.monotonic() > deadline:
                    missing = [r for r, k in enumerate(keys) if k not in present]
                    raise RendezvousError(
                        f"node(s) {missing} did not arrive for {what} within "
                        f"{self.timeout_s:.0f} s (rendezvous {self.endpoint})")
                time.sleep(POLL_S)
        except RendezvousError:
            raise
        except Exception as exc:
            raise self._lost(exc) from None

    def _lost(self, exc: Exception) -> RendezvousError:
        return RendezvousError(f"lost the rendezvous store at {self.endpoint} (the node "
                               f"hosting it stopped or is unreachable): {_root(exc)}")


def _delta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _root(exc: BaseException | None) -> str:
    """The innermost cause's text, on one line (torch wraps the useful part)."""
    while exc is not None and exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc or "unknown error").strip().splitlines()
    return text[0] if text else type(exc).__name__
