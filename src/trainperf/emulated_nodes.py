"""Several nodes on one machine: each node a network namespace with its own address on a bridge,
joined to it by a veth pair whose two ends are shaped to a chosen rate (``tc ... tbf``), its own
share of the cores and, on a GPU machine, its own GPUs, which NCCL is told belong to another
host. The nodes then run exactly what they would run on a cluster, over links that can be slowed
or cut while they run.

Everything made is written down before it is made, in a file of ``STATE_DIR`` named by the
set's tag and holding the owner's process id and start time. The file is created whole and
exclusively, so a tag is one set's only: two sets made at once never share one. ``remove``
takes it all down (the processes left in the namespaces first); ``clean_leftovers``, called
before a new set is made, takes down every set whose owner is gone (a kill -9, a crash), so
nothing outlives the next start. This runs as root, so a state file is trusted only as far as
it names what a set of that tag is made of (``state_problem``): any other file, or any other
name in it, is left alone and said. Standard library and psutil only; root (CAP_NET_ADMIN,
CAP_SYS_ADMIN) and iproute2 are needed, and their absence is said in one line.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

STATE_DIR = Path(os.environ.get("TRAINPERF_EMULATED_STATE", "/run/trainperf/emulated"))
PREFIX = "tpe"
"""Every namespace, bridge and link a set makes is named ``tpe<tag>...`` (15 characters at
most, the kernel's limit for a link's name)."""
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
BURST_S = 0.002
"""A token bucket holds this much of its rate: shallow enough that a long message moves at the
rate, and that a link left idle (a step's forward pass) saves up no more than 2 ms of it."""
MIN_BURST_BYTES = 16 * 1024
"""The bucket's floor at low rates: ten full-size frames. tbf cuts a larger GSO segment into
frames itself; a deeper floor would let every message after an idle spell start at line speed
(128 KiB is 52 ms of a 20 Mbit/s link)."""
QUEUE_S = 0.1
"""How long a packet may wait in a link's queue before it is dropped (tbf's latency)."""
CONGESTION_CONTROL = "reno"
"""TCP's congestion control inside a shaped node. The host's default may be BBR, whose
bandwidth probing against a token bucket loses 5-20% of a 20 Mbit/s link from one message to
the next (gloo all-reduces of 4 MiB measured at 1.7-2.4 MB/s); reno, which every kernel
allows, fills it (2.34-2.39 MB/s, steady). Both carry 5 Gbit/s alike."""
NCCL_SEPARATE_HOSTS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
                       "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_MNNVL_ENABLE": "0",
                       "NCCL_NVLS_ENABLE": "0"}
"""What NCCL is told so that ranks of two emulated nodes talk as ranks of two hosts do, over
the node's link: another host id (``NCCL_HOSTID``, set per node), no peer-to-peer copies or
shared memory between them, its socket transport rather than InfiniBand (NCCL's documented
environment variables)."""


TAG_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"
TAG_LENGTH = 6
"""A set's tag: 6 random letters and digits (36^6 of them), so that names stay within the
kernel's 15 characters (``tpe`` + tag + ``n`` + up to 5 digits of node)."""
TAG_PATTERN = re.compile(rf"[{TAG_CHARS}]{{{TAG_LENGTH}}}")


def new_tag() -> str:
    return "".join(secrets.choice(TAG_CHARS) for _ in range(TAG_LENGTH))


def set_name(tag: str, part: str, node: int | str = "") -> str:
    """The one naming of what a set makes: ``tpe<tag>br`` (its bridge), ``tpe<tag>n<k>``
    (node k's namespace), ``tpe<tag>h<k>`` (the bridge's end of its link), ``tpe<tag>e<k>``
    (the node's own end)."""
    return f"{PREFIX}{tag}{part}{node}"


def set_names(tag: str, nodes: int) -> dict:
    """What a set of ``tag`` with ``nodes`` nodes is made of, by name."""
    return {"bridge": set_name(tag, "br"),
            "namespaces": [set_name(tag, "n", n) for n in range(nodes)],
            "links": [set_name(tag, "h", n) for n in range(nodes)]}


def state_problem(path: Path, state: object) -> str | None:
    """Why a state file is not one a set wrote (None where it is): its name, its tag and every
    name in it must be those of the set its tag names, so that nothing else on the machine (a
    namespace, a link, a folder under /etc/netns) is ever killed or deleted on its word."""
    if not isinstance(state, dict):
        return "not a state file of emulated nodes"
    tag = state.get("tag")
    if not isinstance(tag, str) or not TAG_PATTERN.fullmatch(tag):
        return f"its tag {tag!r} is not one emulate makes"
    if path.name != f"{PREFIX}{tag}.json":
        return f"its name does not carry its tag {tag}"
    namespaces = state.get("namespaces")
    if not isinstance(namespaces, list) or not 1 <= len(namespaces) <= 99999:
        return "it lists no namespaces"
    names = set_names(tag, len(namespaces))
    for key in ("bridge", "namespaces", "links"):
        if state.get(key) != names[key]:
            return f"its {key} {state.get(key)!r} are not the set {tag}'s ({names[key]!r})"
    if not isinstance(state.get("owner"), int) or \
            not isinstance(state.get("owner_started"), (int, float)):
        return "it names no owner"
    return None


class EmulationError(RuntimeError):
    """Emulated nodes cannot be made or run here; the message is one line."""


def parse_rate(text: str) -> int:
    """``100mbit``, ``1gbit``, ``5Gbit`` or a plain number of bits per second -> bit/s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]?bit)?\s*", text.lower())
    if not m:
        raise ValueError(f"a link rate is a number with kbit, mbit or gbit, e.g. 1gbit; "
                         f"got {text!r}")
    rate = float(m.group(1)) * RATE_UNITS[m.group(2) or "bit"]
    if rate < 10**5:
        raise ValueError(f"a link rate below 100kbit is not a network; got {text!r}")
    return int(rate)


def rate_text(bps: int | None) -> str:
    if bps is None:
        return "unlimited"
    for unit in ("gbit", "mbit", "kbit"):
        if bps >= RATE_UNITS[unit]:
            return f"{bps / RATE_UNITS[unit]:g}{unit}"
    return f"{bps}bit"


def missing_privilege() -> str | None:
    """What stops this process from making namespaces and links, or None."""
    if shutil.which("ip") is None:
        return "emulated nodes need iproute2's `ip` (Debian: apt install iproute2)"
    if shutil.which("tc") is None:
        return "emulated nodes need iproute2's `tc` to shape their links"
    if os.geteuid() != 0:
        return ("emulated nodes need root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to make network "
                "namespaces and links; run as root")
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise EmulationError(f"`{' '.join(args)}` failed: "
                             f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done


CLONE_NEWUTS = 0x04000000
NETNS_ETC = Path("/etc/netns")
"""``ip netns exec NS`` mounts the files of ``/etc/netns/NS/`` over ``/etc``'s: where each
node's ``hosts`` lies."""


def _enter_node(name: str, cores: list[int]) -> None:
    """In a node's process before it runs: it goes when the process that made the set goes,
    even by kill -9; it runs on the node's cores; and it has a host name of its own, as a
    cluster's node has (Horovod's gloo binds to the address of the host's name)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    os.sched_setaffinity(0, cores)
    if libc.unshare(CLONE_NEWUTS) == 0:
        socket.sethostname(name)


@dataclass
class EmulatedNodes:
    """``nodes`` namespaces on one bridge. ``rate_bps``: each link's rate, both ways (None:
    unshaped). ``gpus``: the GPU indices handed out, ``len(gpus) // nodes`` to each node."""

    nodes: int
    rate_bps: int | None = None
    gpus: tuple[int | str, ...] = ()
    tag: str = ""
    subnet: str = ""
    cores: tuple[int, ...] = ()
    made: bool = field(default=False, repr=False)
    left_alone: list[str] = field(default_factory=list, repr=False)
    """Files in the state folder that no set wrote, found when this set was made."""
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus and len(self.gpus) < self.nodes:
            raise ValueError(f"{len(self.gpus)} GPU(s) cannot give each of {self.nodes} nodes "
                             f"its own")
        self.tag = self.tag or new_tag()
        self.cores = self.cores or tuple(sorted(os.sched_getaffinity(0)))

    # ------------------------------------------------------------------------- names

    @property
    def bridge(self) -> str:
        return set_name(self.tag, "br")

    def namespace(self, node: int) -> str:
        return set_name(self.tag, "n", node)

    def host_link(self, node: int) -> str:
        """The bridge's end of node ``node``'s link."""
        return set_name(self.tag, "h", node)

    def node_link(self, node: int) -> str:
        """The node's own interface, inside its namespace."""
        return set_name(self.tag, "e", node)

    def addr(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"{PREFIX}{self.tag}.json"

    def node_cores(self, node: int) -> list[int]:
        """The cores node ``node`` runs on: an equal share, or all of them where there are
        fewer cores than nodes."""
        share = len(self.cores) // self.nodes
        if share == 0:
            return list(self.cores)
        return list(self.cores[node * share:(node + 1) * share])

    def node_gpus(self, node: int) -> list[int | str]:
        share = len(self.gpus) // self.nodes
        return list(self.gpus[node * share:(node + 1) * share])

    # ---------------------------------------------------------------- making, removing

    def make(self) -> "EmulatedNodes":
        why = missing_privilege()
        if why:
            raise EmulationError(why)
        self.left_alone = clean_leftovers()[1]
        self.subnet = self.subnet or free_subnet()
        self._claim_state()
        try:
            _ip("ip", "link", "add", self.bridge, "type", "bridge")
            _ip("ip", "link", "set", self.bridge, "up")
            for node in range(self.nodes):
                self._make_node(node)
            self.made = True
            self._check_reachable()
        except BaseException:
            self.remove()
            raise
        return self

    def _make_node(self, node: int) -> None:
        ns, host, inner = self.namespace(node), self.host_link(node), self.node_link(node)
        _ip("ip", "netns", "add", ns)
        _ip("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
        _ip("ip", "link", "set", inner, "netns", ns)
        _ip("ip", "link", "set", host, "master", self.bridge)
        _ip("ip", "link", "set", host, "up")
        _ip("ip", "-n", ns, "addr", "add", f"{self.addr(node)}/24", "dev", inner)
        _ip("ip", "-n", ns, "link", "set", inner, "up")
        _ip("ip", "-n", ns, "link", "set", "lo", "up")
        if self.rate_bps is not None:
            self.set_rate(node, self.rate_bps)
        etc = NETNS_ETC / ns
        etc.mkdir(parents=True, exist_ok=True)
        # Every node's name resolves to its address on every node, as a cluster's hosts file
        # says; the node's own name is not loopback (Debian's 127.0.1.1 would be).
        (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{self.addr(n)} {self.namespace(n)}\n" for n in range(self.nodes)))

    def _check_reachable(self) -> None:
        """Node 1 knocks on node 0's address: a refused connection proves the bridge carries
        their packets; silence means something on the host filters bridged traffic."""
        if self.nodes < 2:
            return
        probe = ("import socket, sys\ns = socket.socket(); s.settimeout(3)\n"
                 f"try: s.connect(({self.addr(0)!r}, 9))\n"
                 "except ConnectionRefusedError: sys.exit(0)\n"
                 "except OSError as e: sys.exit(str(e))\n")
        done = subprocess.run(["ip", "netns", "exec", self.namespace(1), sys.executable, "-c",
                               probe], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise EmulationError(
                f"node 1 cannot reach node 0 across bridge {self.bridge} "
                f"({done.stderr.strip() or 'no answer'}); a firewall on this host may filter "
                "bridged traffic (net.bridge.bridge-nf-call-iptables)")

    def _claim_state(self) -> None:
        """Write the set down under its tag, whole and exclusively: written aside, then linked
        to its name, which fails where the name is taken (another set's, live or left over);
        the set then takes a fresh tag. Nobody ever reads half a state file."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        me = psutil.Process()
        for _ in range(20):
            aside = STATE_DIR / f".{self.tag}-{me.pid}.tmp"
            aside.write_text(json.dumps({
                "owner": me.pid, "owner_started": me.create_time(), "tag": self.tag,
                **set_names(self.tag, self.nodes), "subnet": self.subnet}))
            try:
                os.link(aside, self.state_file)
                return
            except FileExistsError:
                self.tag = new_tag()
            finally:
                aside.unlink(missing_ok=True)
        raise EmulationError(f"no free tag for a set of emulated nodes in {STATE_DIR}")

    def remove(self) -> None:
        """Stop every process of the set and take down its namespaces, links and bridge."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # What this set made, by the names it made them under: never what a file says.
        remove_set(set_names(self.tag, self.nodes))
        self.state_file.unlink(missing_ok=True)
        self.made = False

    def __enter__(self) -> "EmulatedNodes":
        return self.make()

    def __exit__(self, *exc) -> None:
        self.remove()

    # -------------------------------------------------------------------- the links

    def set_rate(self, node: int, rate_bps: int | None) -> None:
        """Shape node ``node``'s link both ways (its own end sends, the bridge's end
        delivers); None takes the shaping off. A shaped node's TCP runs CONGESTION_CONTROL,
        an unshaped one the host's own."""
        control = CONGESTION_CONTROL
        if rate_bps is None:  # the host's own, read in the host's namespace
            control = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
        if control:
            _ip("ip", "netns", "exec", self.namespace(node), "sysctl", "-qw",
                f"net.ipv4.tcp_congestion_control={control}")
        for netns, dev in ((self.namespace(node), self.node_link(node)),
                           (None, self.host_link(node))):
            where = ["ip", "netns", "exec", netns] if netns else []
            # A rate changes on a fresh queue, its packets dropped (TCP sends them again): tbf
            # cuts a packet larger than its bucket into frames as it enters only, so a bucket
            # shrunk under large (GSO) packets already queued never lets them out, and the
            # link carries nothing more (seen: 510,530 bytes in 16 packets held for good).
            _ip(*where, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate_bps is None:
                continue
            burst = max(MIN_BURST_BYTES, int(rate_bps / 8 * BURST_S))
            _ip(*where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", f"{rate_bps}bit", "burst", str(burst), "latency",
                f"{int(QUEUE_S * 1000)}ms")

    def cut(self, node: int) -> None:
        """Pull node ``node``'s cable: the bridge's end goes down, the node sees no carrier."""
        _ip("ip", "link", "set", self.host_link(node), "down")

    def restore(self, node: int) -> None:
        _ip("ip", "link", "set", self.host_link(node), "up")

    # -------------------------------------------------------------------- running

    def node_env(self, node: int, base: dict[str, str] | None = None) -> dict[str, str]:
        """A node's environment: its GPUs (none where the set has none) and, for NCCL,
        another host and this node's interface."""
        env = dict(os.environ if base is None else base)
        env["TRAINPERF_EMULATED_NODE"] = str(node)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.node_gpus(node)))
            env.update(NCCL_SEPARATE_HOSTS)
            env["NCCL_HOSTID"] = f"trainperf-{self.tag}-node{node}"
            env["NCCL_SOCKET_IFNAME"] = self.node_link(node)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def start(self, node: int, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` as node ``node``: inside its namespace, on its cores, stopped
        (SIGTERM) when this process ends, however it ends."""
        if not self.made:
            raise EmulationError("the emulated nodes are not made yet")
        cores, name = self.node_cores(node), self.namespace(node)
        env = popen.pop("env", None)
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(node), *argv],
                                env=self.node_env(node, env),
                                preexec_fn=lambda: _enter_node(name, cores), **popen)
        self._procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process still inside one of the set's namespaces."""
        return [pid for n in range(self.nodes) for pid in namespace_pids(self.namespace(n))]


def namespace_pids(ns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def remove_set(state: dict) -> None:
    """Take down one set from its state: kill what runs in its namespaces, then the namespaces
    (which takes their ends of the links), the bridge's ends and the bridge."""
    for ns in state.get("namespaces", []):
        for pid in namespace_pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for ns in state.get("namespaces", []):
        deadline = time.monotonic() + 5
        while namespace_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.05)
        _ip("ip", "netns", "del", ns, check=False)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    for link in [*state.get("links", []), state.get("bridge")]:
        if link:
            _ip("ip", "link", "del", link, check=False)


def _owner_alive(state: dict) -> bool:
    try:
        proc = psutil.Process(int(state["owner"]))
        return abs(proc.create_time() - float(state["owner_started"])) < 1.0
    except (psutil.NoSuchProcess, KeyError, ValueError):
        return False


def read_states() -> tuple[list[tuple[Path, dict]], list[tuple[Path, str]]]:
    """(every state file that a set wrote, with its state; every other file there that looks
    like one, with why it is not)."""
    good, bad = [], []
    if not STATE_DIR.is_dir():
        return good, bad
    for path in sorted(STATE_DIR.glob(f"{PREFIX}*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            bad.append((path, f"unreadable ({type(exc).__name__})"))
            continue
        why = state_problem(path, state)
        if why:
            bad.append((path, why))
        else:
            good.append((path, state))
    return good, bad


def clean_leftovers() -> tuple[list[str], list[str]]:
    """Take down every set whose owner is gone: (their tags, a line for each file left alone,
    naming it and why)."""
    good, bad = read_states()
    removed = []
    for path, state in good:
        if _owner_alive(state):
            continue
        remove_set(set_names(state["tag"], len(state["namespaces"])))
        path.unlink(missing_ok=True)
        removed.append(state["tag"])
    return removed, [f"{path}: {why}; nothing it names was touched (remove it by hand)"
                     for path, why in bad]


def free_subnet() -> str:
    """A 10.x.y.0/24 that no interface of this machine is on, nor any live set's nodes."""
    taken = [ipaddress.ip_network(f"{a.address}/{a.netmask}", strict=False)
             for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family.name == "AF_INET" and a.netmask]
    for _, state in read_states()[0]:
        try:
            taken.append(ipaddress.ip_network(f"{state.get('subnet')}.0/24"))
        except ValueError:
            pass
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{random.randrange(64, 250)}."
                                   f"{random.randrange(0, 256)}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return str(net.network_address).rsplit(".", 1)[0]
    raise EmulationError("no free 10.x.y.0/24 subnet for the emulated nodes")
