"""What a backend is: a small description the runner launches any framework through.

Everything here is the standard library, so a framework's own environment can import it and the
runner never imports a framework.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..config import Topology, Tuning


COLLECTIVE_TIMEOUT_ENV = "TRAINPERF_COLLECTIVE_TIMEOUT_S"
"""Seconds a rank waits in a collective before it gives its peer up (set for multi-node runs)."""


@dataclass(frozen=True)
class EnvSpec:
    """How to build the framework's own environment (``trainperf env create NAME``)."""

    packages: tuple[str, ...]
    """pip requirements on a machine without CUDA: the framework and the numpy it needs."""
    cuda_packages: tuple[str, ...]
    """The same on a machine with an NVIDIA GPU (the framework's CUDA build)."""
    probe: str
    """Python run in the environment that prints a JSON object of the versions it holds."""
    pythons: tuple[str, ...] = ()
    """Python versions the framework's wheels exist for (``3.10``...), best first; empty: any,
    and the environment uses trainperf's own interpreter."""
    no_deps_packages: tuple[str, ...] = ()
    """Installed after ``packages`` without their dependencies (libraries a wheel loads but
    does not declare)."""


@dataclass(frozen=True)
class Cluster:
    """Where every process of a run lives, as each node's launcher sees it: the nodes'
    addresses and, per node, ports free there for this run. Made by the runner after the nodes
    have met (``trainperf.scale.rendezvous``), or for one node over loopback."""

    node_rank: int
    nproc_per_node: int
    addrs: tuple[str, ...]
    """One per node rank, each reachable from every other node."""
    ports: tuple[tuple[int, ...], ...]
    """One tuple per node rank: ports free on that node (the first of node 0 is the run's
    coordinator or master port)."""

    def __post_init__(self) -> None:
        if len(self.addrs) != len(self.ports) or not self.addrs:
            raise ValueError("a cluster needs one address and one port list per node")
        if not 0 <= self.node_rank < len(self.addrs):
            raise ValueError(f"node rank {self.node_rank} outside {len(self.addrs)} nodes")

    @property
    def nnodes(self) -> int:
        return len(self.addrs)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def master(self) -> tuple[str, int]:
        return self.addrs[0], self.ports[0][0]

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def to_json(self) -> str:
        return json.dumps({"node_rank": self.node_rank, "nproc_per_node": self.nproc_per_node,
                           "addrs": list(self.addrs), "ports": [list(p) for p in self.ports]})

    @classmethod
    def from_json(cls, text: str) -> "Cluster":
        d = json.loads(text)
        return cls(int(d["node_rank"]), int(d["nproc_per_node"]), tuple(d["addrs"]),
                   tuple(tuple(int(x) for x in p) for p in d["ports"]))


@dataclass(frozen=True)
class LaunchRequest:
    """What a backend needs to start one run."""

    python: str
    """The interpreter of the backend's environment."""
    topology: Topology
    tuning: Tuning
    spec_path: Path
    events_path: Path
    cluster: Cluster | None = None
    """Several nodes: where every node is (None: one node, over loopback)."""
    cluster_path: Path | None = None
    """``cluster`` as JSON, written by the runner for launchers that take ``--cluster``."""
    logs_dir: Path | None = None
    """Where each process's output file goes (None: the launcher's own output)."""

    @property
    def worker_args(self) -> list[str]:
        return ["--spec", str(self.spec_path), "--events", str(self.events_path)]


@dataclass(frozen=True)
class Launch:
    """One command that starts every process of a run (and stops them all when it is
    stopped), and the variables it adds to the environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Backend:
    name: str
    """What ``--framework`` takes: ``torch``, ``mxnet``..."""
    framework: str
    """What the worker writes as ``env.framework`` (``pytorch``, ``mxnet``)."""
    launch: Callable[[LaunchRequest], Launch]
    env: EnvSpec | None = None
    """None: the backend runs in trainperf's own interpreter."""
    fc_modes: tuple[str, ...] = ("dp", "mp", "pfc")
    max_nodes: int | None = None
    """Most nodes the backend's launch can span (None: no limit)."""
    cannot_run: str | None = None
    """Why this backend's environment can be built but no run started (None: it runs)."""
    trains: bool = False
    """Its worker can train to a verification accuracy (``trainperf train``): real-data input,
    checkpoints and verification sets."""

    def check(self, fc: str, nnodes: int, train: bool = False) -> None:
        """ValueError when this backend cannot run the asked workload and layout."""
        if train and not self.trains:
            raise ValueError(f"the {self.name} backend does not train to accuracy yet (its "
                             "worker has no real-data input, checkpoints or verification); "
                             "`trainperf train` runs --framework torch")
        if self.cannot_run:
            raise ValueError(f"the {self.name} backend cannot run yet: {self.cannot_run}")
        if fc not in self.fc_modes:
            raise ValueError(f"the {self.name} backend runs --fc {', '.join(self.fc_modes)}; "
                             f"not {fc}")
        if self.max_nodes is not None and nnodes > self.max_nodes:
            raise ValueError(f"the {self.name} backend runs on one node here; multi-node "
                             f"launch is not available for it yet")
