"""What a backend is: a small description the runner launches any framework through.

Everything here is the standard library, so a framework's own environment can import it and the
runner never imports a framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..config import Topology, Tuning


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
class LaunchRequest:
    """What a backend needs to start one run."""

    python: str
    """The interpreter of the backend's environment."""
    topology: Topology
    tuning: Tuning
    spec_path: Path
    events_path: Path

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

    def check(self, fc: str, nnodes: int) -> None:
        """ValueError when this backend cannot run the asked workload and layout."""
        if self.cannot_run:
            raise ValueError(f"the {self.name} backend cannot run yet: {self.cannot_run}")
        if fc not in self.fc_modes:
            raise ValueError(f"the {self.name} backend runs --fc {', '.join(self.fc_modes)}; "
                             f"not {fc}")
        if self.max_nodes is not None and nnodes > self.max_nodes:
            raise ValueError(f"the {self.name} backend runs on one node here; multi-node "
                             f"launch is not available for it yet")
