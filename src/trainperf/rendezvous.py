"""The nodes of a multi-node plan meet on a store, before every run and after it.

Every node runs the same ``trainperf run ... --nnodes N``. With ``--rdzv HOST:PORT`` the first
meeting is torch's c10d dynamic rendezvous, which gives each node its rank, and the node whose
address is HOST hosts the store; with ``--node-rank R --master-addr H --master-port P`` the ranks
are given by hand and node 0 (at H) hosts a plain TCP store on P. Either way the store lives as
long as the hosting runner. Before every run the nodes meet again on it under the run's name:
each publishes ports it has reserved (``backends.ports``: held until its next meeting), so that
every backend can be told where every rank of the run listens (``Cluster``). After every run
each node tells the others how its part ended, so that a rank that died on one node fails the
run on every node, with its cause, and no node waits on a dead peer. A node that does not
arrive within the timeout, or whose store went away with its node, turns into
``RendezvousError``, which the runner records as the run's failure.

Node ranks stay fixed for the life of the runners, so one node (rank 0) holds every measurement.

What a node can tell of the network by itself lives here too: whether its own link is up (the
kernel's carrier and operational state of the interface it met the others on, ``link_state``),
and, with ``probe``, a small echo service each node runs for the others' link probes
(``ProbeServer``, ``ProbeLink``: a block sent, one byte back), published with its address.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from .backends import ports
from .backends.base import Cluster

POLL_S = 0.1
DEFAULT_TIMEOUT_S = 300.0
FAREWELL_S = 10.0
"""How long the hosting node waits, when its plan is done, for the others to have read what
they still needed from its store (the last run's outcomes)."""
_STORES: list[Any] = []
"""Every store this process opened, kept until it exits: a store this process hosts may
serve another plan's meetings (``--data`` runs two plans through one endpoint), and the other
nodes' last meetings, after this node's own plan is done."""
_HOSTED: dict[int, Any] = {}
"""The plain TCP stores this process hosts (hand-given ranks), by port: a second plan through
the same endpoint meets on the same store."""
SYS_NET = Path("/sys/class/net")
DOWN_STATES = ("down", "lowerlayerdown", "notpresent")
"""Operational states (RFC 2863, as the kernel names them) of an interface that carries
nothing: ``lowerlayerdown`` is a link whose other end is gone (a veth's peer, a bonded port)."""
ARRIVED_KEY = "trainperf-arrived"
"""Counts, on a ``--rdzv`` store, the nodes that reached it: what a timed-out rendezvous says
came of how many."""


class RendezvousError(RuntimeError):
    """The nodes could not meet (a node missing, the store lost, plans that differ)."""


@dataclass(frozen=True)
class LinkState:
    """This node's interface as the kernel sees it (``/sys/class/net/IFACE``)."""

    iface: str
    carrier: bool | None
    """Whether the interface senses its link partner; None where the kernel does not say
    (an interface set down by hand)."""
    operstate: str

    @property
    def down(self) -> bool:
        """Nothing can cross the link: no carrier, or an operational state that carries
        nothing. Loopback (``unknown``, carrier 1) and an interface whose driver reports no
        state are up."""
        return self.carrier is False or self.operstate in DOWN_STATES

    def text(self) -> str:
        if not self.down:
            return f"{self.iface} is up"
        said = "no carrier" if self.carrier is False else "down"
        return f"{self.iface}: {said}, operstate {self.operstate}"


def link_state(iface: str | None) -> LinkState | None:
    """The state of this node's interface ``iface`` (in this process's network namespace);
    None where there is no such interface to read."""
    if not iface:
        return None
    base = SYS_NET / iface
    try:
        operstate = (base / "operstate").read_text().strip().lower()
    except OSError:
        return None
    try:
        carrier: bool | None = (base / "carrier").read_text().strip() == "1"
    except OSError:  # EINVAL while the interface is administratively down
        carrier = None
    return LinkState(iface, carrier, operstate)


def own_link_note(addr: str) -> str:
    """``; this node's link IFACE: no carrier...`` where the interface holding ``addr`` is down,
    else empty: a node that cannot reach the others says whether the fault is its own link."""
    state = link_state(interface_of(addr)) if addr else None
    return f"; this node's link is down ({state.text()})" if state and state.down else ""


PROBE_ACK = b"k"
PROBE_HEADER = struct.Struct("!Q")
"""A probe is an 8-byte length, the block, and one byte back once all of it arrived."""


PROBE_MAX_BYTES = 16 << 20
"""The largest block a probe server takes (probes send 1 MiB): a larger length is no probe."""
PROBE_MAX_CONNECTIONS = 16
"""Probers a server answers at once (node 0 keeps one connection per other node); more are
closed as they come."""
PROBE_IDLE_S = 120.0
"""A prober silent this long is let go (node 0 probes every PROBE_MAX_S, 60 s, at most)."""


class ProbeServer:
    """Answers other nodes' link probes on ``addr`` (a port the kernel picks), one thread per
    prober, ``PROBE_MAX_CONNECTIONS`` at most, until ``close``. It listens on a node's address
    for the length of a run: what it reads is bounded (a block of ``PROBE_MAX_BYTES`` at most,
    a prober silent ``PROBE_IDLE_S`` let go)."""

    def __init__(self, addr: str) -> None:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.sock = socket.create_server((addr, 0), family=family)
        self.port = self.sock.getsockname()[1]
        self._closed = threading.Event()
        self._slots = threading.BoundedSemaphore(PROBE_MAX_CONNECTIONS)
        threading.Thread(target=self._accept, daemon=True, name="link-probe-server").start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            self._slots.release()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(PROBE_IDLE_S)
            try:
                while not self._closed.is_set():
                    left = PROBE_HEADER.unpack(_read_exactly(conn, PROBE_HEADER.size))[0]
                    if left > PROBE_MAX_BYTES:
                        return  # no probe of ours
                    while left:
                        chunk = conn.recv(min(left, 1 << 16))
                        if not chunk:
                            return
                        left -= len(chunk)
                    conn.sendall(PROBE_ACK)
            except (OSError, ConnectionError, struct.error):
                return

    def close(self) -> None:
        self._closed.set()
        try:
            self.sock.close()
        except OSError:
            pass


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the prober closed the connection")
        data += chunk
    return data


class ProbeLink:
    """One node's side of the link probes to another: a connection kept for the probes, made
    again after a failed one."""

    def __init__(self, addr: str, port: int, timeout_s: float) -> None:
        self.addr, self.port, self.timeout_s = addr, port, timeout_s
        self._sock: socket.socket | None = None

    def measure(self, block: bytes) -> float | None:
        """Seconds from sending ``block`` to the other node's acknowledgement of all of it;
        None where the probe failed (the node unreachable within the timeout)."""
        try:
            if self._sock is None:
                self._sock = socket.create_connection((self.addr, self.port), self.timeout_s)
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            started = time.perf_counter()
            self._sock.sendall(PROBE_HEADER.pack(len(block)) + block)
            if _read_exactly(self._sock, 1) != PROBE_ACK:
                raise ConnectionError("the probed node answered something else")
            return time.perf_counter() - started
        except (OSError, ConnectionError):
            self.close()
            return None

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


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


def rank_order(holds: list[str | None]) -> list[int]:
    """The node ranks after a rendezvous, as the rendezvous's ranks in their new order: the
    node whose folder holds the plan's measurements (``holds``, by rendezvous rank) first,
    every other in its place, so that a job resumed anyhow keeps its figures on node 0. The
    one folder without records is that node's where every other holds a follower's (node 0
    stopped before it recorded a run the others did). RendezvousError where two hold
    measurements: one run's figures are on one node."""
    leaders = [r for r, h in enumerate(holds) if h == "leader"]
    if len(leaders) > 1:
        raise RendezvousError(f"the folders of nodes {leaders} (as the rendezvous ranked them) "
                              "each hold measurements of this plan: resume each job's own "
                              "node folders")
    empty = [r for r, h in enumerate(holds) if h is None]
    if leaders:
        first = leaders[0]
    elif len(empty) == 1 and len(holds) > 1:
        first = empty[0]
    else:
        return list(range(len(holds)))
    order = list(range(len(holds)))
    order[0], order[first] = order[first], order[0]
    return order


@dataclass
class NodeGroup:
    """This node's place among the nodes of one plan."""

    endpoint: str
    nnodes: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    run_id: str = "trainperf"
    node_rank: int | None = None
    """Given by hand (``--node-rank``): node 0 hosts a plain store at ``endpoint``. None: the
    rendezvous assigns it."""
    addrs: tuple[str, ...] = ()
    local_addr: str = ""
    hosting: bool = False
    """This node's runner hosts the store."""
    probe: bool = False
    """Run a ``ProbeServer`` for the other nodes' link probes, its port published when the
    nodes first meet (``probe_ports``)."""
    probe_ports: tuple[int | None, ...] = ()
    """Each node's probe port, by node rank (None: that node runs none)."""
    _probe_server: ProbeServer | None = field(default=None, repr=False)
    _store: Any = field(default=None, repr=False)
    _handler: Any = field(default=None, repr=False)
    _held: ports.Reservation | None = field(default=None, repr=False)
    """The ports this node published at the last meeting, held until the next one."""

    def join(self, settings: dict[str, Any], holds: str | None = None) -> None:
        """Meet the other nodes once: node rank, every node's address, and the check that all
        run the same plan. ``holds``: what this node's folder of the plan holds from an earlier
        run that stopped (``leader``: the measurements, ``follower``: a follower's records,
        None: nothing); at a rendezvous the node with the measurements becomes node 0
        (``rank_order``), so that a resumed job's figures go on where they are."""
        if self.node_rank is not None:
            self._join_by_hand()
            by_hand = True
        else:
            self._join_rendezvous()
            by_hand = False
        digest = settings_digest(settings)
        if self.probe and self._probe_server is None:
            try:
                self._probe_server = ProbeServer(self.local_addr)
            except OSError:
                pass  # no probes of this node's link; everything else goes on
        port = self._probe_server.port if self._probe_server else None
        self._set(f"node/{self.node_rank}", json.dumps({"addr": self.local_addr,
                                                         "plan": digest, "probe": port,
                                                         "holds": holds}))
        nodes = [json.loads(v) for v in self._wait_all("node", "the first meeting")]
        differ = [r for r, n in enumerate(nodes) if n["plan"] != digest]
        if differ:
            raise RendezvousError(f"node(s) {differ} run another plan than node "
                                  f"{self.node_rank}: start every node with the same options")
        order = list(range(len(nodes))) if by_hand else rank_order(
            [n.get("holds") for n in nodes])
        # Every node computes the same order from the same records: new rank i is the node
        # the rendezvous ranked order[i].
        self.node_rank = order.index(self.node_rank)
        self.addrs = tuple(nodes[r]["addr"] for r in order)
        self.probe_ports = tuple(nodes[r].get("probe") for r in order)

    def rank_as_far_as_known(self) -> int:
        """This node's rank where the first meeting failed: the one it was given or assigned;
        before the rendezvous assigned one, 0 for the node hosting its store (at most one node
        does) and 1 for any other, so that a failed meeting leaves at most one leader."""
        if self.node_rank is not None:
            return self.node_rank
        return 0 if self.hosting else 1

    def _join_by_hand(self) -> None:
        """Node 0 hosts a TCP store at the endpoint (its own address); the others connect,
        retrying until the timeout."""
        from torch.distributed import PrefixStore, TCPStore

        host, port = parse_endpoint(self.endpoint)
        self.local_addr = local_addr_towards(host, port)
        self.hosting = self.node_rank == 0
        try:
            if self.hosting:
                store = _HOSTED.get(port)
                if store is None:
                    store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                                     timeout=_delta(max(60.0, self.timeout_s)))
                    _HOSTED[port] = store
            else:
                store = TCPStore(host, port, is_master=False,
                                 timeout=_delta(self.timeout_s))
        except Exception as exc:
            raise RendezvousError(f"cannot reach node 0 at {self.endpoint} within "
                                  f"{self.timeout_s:.0f} s: {_root(exc)}"
                                  f"{own_link_note(self.local_addr)}") from None
        _STORES.append(store)
        self._store = PrefixStore(self.run_id, store)

    def _join_rendezvous(self) -> None:
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
                self.hosting = hosting
                break
            except (TorchRdzvError, RuntimeError, ValueError) as exc:
                last = exc
        else:
            raise RendezvousError(f"cannot reach the rendezvous at {self.endpoint}: "
                                  f"{_root(last)}{own_link_note(self.local_addr)}")
        self._handler = DynamicRendezvousHandler.from_backend(
            self.run_id, store, backend, self.nnodes, self.nnodes, self.local_addr, timeout)
        # Each node counts itself in on the store before it waits: a rendezvous that times out
        # then says how many came, which torch's own state no longer holds (a node that gives
        # up removes itself from it first).
        arrived_key = f"{ARRIVED_KEY}/{self.run_id}"
        try:
            store.add(arrived_key, 1)
        except Exception:
            pass  # the count is only for the message
        started = time.monotonic()
        try:
            info = self._handler.next_rendezvous()
        except TorchRdzvTimeout:
            try:
                came = f"{store.add(arrived_key, 0)} of {self.nnodes} came"
            except Exception:
                came = "how many came is unknown: the store is gone"
            raise RendezvousError(
                f"the {self.nnodes} nodes did not all arrive at the rendezvous {self.endpoint} "
                f"within {time.monotonic() - started:.0f} s ({came})"
                f"{own_link_note(self.local_addr)}") from None
        except TorchRdzvError as exc:
            raise RendezvousError(f"the rendezvous at {self.endpoint} failed: "
                                  f"{_root(exc)}") from None
        self._store, self.node_rank = info.store, info.rank

    def meet(self, label: str, nproc_per_node: int, nports: int) -> Cluster:
        """Meet again before run ``label``: every node's ports for it, each node's reserved
        (``ports.reserve``) until its next meeting or ``close``."""
        if self._store is None or self.node_rank is None:
            raise RendezvousError("the nodes have not met yet")
        self.release_ports()
        self._held = ports.reserve(nports, self.local_addr)
        self._set(f"run/{label}/{self.node_rank}", json.dumps(list(self._held.ports)))
        found = [json.loads(v) for v in self._wait_all(f"run/{label}", label)]
        return Cluster(self.node_rank, nproc_per_node, self.addrs,
                       tuple(tuple(p) for p in found))

    def tell(self, label: str, outcome: dict[str, Any]) -> None:
        """Publish how this node's part of run ``label`` ended."""
        self._set(f"run/{label}/outcome/{self.node_rank}", json.dumps(outcome))

    def told(self, label: str) -> dict[int, dict[str, Any]]:
        """What the other nodes have told of run ``label`` so far (no waiting)."""
        out = {}
        try:
            for r in range(self.nnodes):
                key = f"run/{label}/outcome/{r}"
                if r != self.node_rank and self._store.check([key]):
                    out[r] = json.loads(self._store.get(key).decode())
        except Exception as exc:
            raise self._lost(exc) from None
        return out

    def beat(self, label: str, value: dict[str, Any]) -> None:
        """Tell the others, while run ``label`` goes, that this node is there (``RunWatch``)."""
        self._set(f"run/{label}/beat/{self.node_rank}", json.dumps(value))

    def beat_of(self, label: str, node: int) -> dict[str, Any] | None:
        """Node ``node``'s last beat of run ``label`` (None: none yet)."""
        key = f"run/{label}/beat/{node}"
        try:
            if not self._store.check([key]):
                return None
            return json.loads(self._store.get(key).decode())
        except Exception as exc:
            raise self._lost(exc) from None

    def hear(self, label: str, deadline: float) -> dict[int, dict[str, Any]]:
        """Every other node's outcome of run ``label``, waiting until ``deadline``
        (``time.monotonic``) at most; a node that has not told by then is left out."""
        while True:
            heard = self.told(label)
            if len(heard) == self.nnodes - 1 or time.monotonic() > deadline:
                return heard
            time.sleep(POLL_S)

    def announce(self, label: str, value: dict[str, Any]) -> None:
        """Publish what this node decided for every node (node 0's choice of a mode)."""
        self._set(f"announce/{label}", json.dumps(value))

    def announcement(self, label: str, timeout_s: float | None = None) -> dict[str, Any]:
        """What a node announced under ``label``, waiting ``timeout_s`` at most (default: the
        group's timeout); RendezvousError where nothing came."""
        return json.loads(self._wait_key(f"announce/{label}", label, timeout_s))

    def release_ports(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None

    def close(self) -> None:
        self.release_ports()
        if self._probe_server is not None:
            self._probe_server.close()
            self._probe_server = None
        if self._store is not None and self.node_rank is not None:
            try:
                # The store goes with this process: the others first read what they need.
                self._store.set(f"bye/{self.node_rank}", "1")
                if self.hosting:
                    self._wait_all("bye", "the farewell", FAREWELL_S)
            except Exception:  # a store that is gone, or a node that never said goodbye
                pass
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

    def _wait_key(self, key: str, what: str, timeout_s: float | None = None) -> str:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            while not self._store.check([key]):
                if time.monotonic() > deadline:
                    raise RendezvousError(f"nothing came for {what} within {timeout_s:.0f} s "
                                          f"(rendezvous {self.endpoint})"
                                          f"{own_link_note(self.local_addr)}")
                time.sleep(POLL_S)
            return self._store.get(key).decode()
        except RendezvousError:
            raise
        except Exception as exc:
            raise self._lost(exc) from None

    def _wait_all(self, prefix: str, what: str, timeout_s: float | None = None) -> list[str]:
        """The value every node wrote under ``prefix/<rank>``, waiting at most ``timeout_s``
        (default: the group's timeout)."""
        keys = [f"{prefix}/{r}" for r in range(self.nnodes)]
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                present = [k for k in keys if self._store.check([k])]
                if len(present) == len(keys):
                    return [self._store.get(k).decode() for k in keys]
                if time.monotonic() > deadline:
                    missing = [r for r, k in enumerate(keys) if k not in present]
                    raise RendezvousError(
                        f"node(s) {missing} did not arrive for {what} within "
                        f"{timeout_s:.0f} s ({len(present)} of {len(keys)} came; rendezvous "
                        f"{self.endpoint}){own_link_note(self.local_addr)}")
                time.sleep(POLL_S)
        except RendezvousError:
            raise
        except Exception as exc:
            raise self._lost(exc) from None

    def _lost(self, exc: Exception) -> RendezvousError:
        return RendezvousError(f"lost the rendezvous store at {self.endpoint} (the node "
                               f"hosting it stopped or is unreachable): {_root(exc)}"
                               f"{own_link_note(self.local_addr)}")


def _delta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _root(exc: BaseException | None) -> str:
    """The innermost cause's text, on one line (torch wraps the useful part)."""
    while exc is not None and exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc or "unknown error").strip().splitlines()
    return text[0] if text else type(exc).__name__
