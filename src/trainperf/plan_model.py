"""The plan a runner runs: its cases (devices and batch), its settings, and the check of a plan
against its backend's declaration before anything starts. Imports no framework."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import results
from .backends import get_backend
from .config import AlignSpec, DataSpec, Measure, Topology, TrainSpec, Tuning, Workload


@dataclass(frozen=True)
class Case:
    topology: Topology
    batch_size: int

    @property
    def key(self) -> results.CaseKey:
        return results.CaseKey(self.topology.nnodes, self.topology.devices_per_node,
                               self.batch_size)


@dataclass
class Plan:
    recipe: str
    workload: Workload
    measure: Measure
    cases: list[Case]
    out_dir: Path
    tuning: Tuning = field(default_factory=Tuning)
    model: str | None = None
    """The model's key in DLPerf's tables and exports (``r100``, ``y1``, ``r50``, ``rn50``)."""
    framework: str = "torch"
    """The backend that runs it (``trainperf.backends``)."""
    align: AlignSpec | None = None
    """Alignment: the start every run loads its weights and batches from, its dtype and where
    it writes its steps (``RunSpec.align``)."""
    data: DataSpec | None = None
    """Real data: the RecordIO dataset and loader every run reads (None: synthetic)."""
    data_role: str = "synthetic"
    """``real``; ``synthetic`` (a plain run); ``synthetic baseline`` (the compute-only twin of a
    real-data plan, which the report sets beside it)."""
    train: TrainSpec | None = None
    """Train to a verification accuracy instead of timing a fixed number of steps; each run
    keeps its checkpoints in its own folder, so ``--resume`` goes on from them."""
    variant: str | None = None
    """What sets this plan apart in a training matrix (``mp fp32``, ``pfc0.1 bf16``)."""
    profile_steps: int | None = None
    """``--breakdown``: after each case's timed runs, one profiled run of this many steps
    (``RunSpec.profile``), kept apart from the runs; None: none. Not a setting of the runs
    (``settings``): a folder measured without it can be resumed with it."""
    trace: bool = False
    """``--trace``: the profiled run also writes the framework's trace into its folder."""
    mode_group: str | None = None
    """``--mode best``: plans that must be timed in one mode share this name and one probe (a
    real-data plan and its synthetic twin, whose ratio is the data's overhead). Not a setting
    of the runs (``settings``). None: the plan probes for itself."""

    decided_mode: dict[str, Any] | None = None
    """``--mode best`` decided elsewhere (``--mode-from``): the probe record of an earlier run
    of this plan, whose choice its timed runs take instead of probing again, so that a node
    sweep's every node count runs in the mode its first case chose. Not a setting of the runs
    (``settings``)."""

    def data_record(self) -> dict[str, Any]:
        """What the results say of the data: its source, and the loader settings asked for."""
        if self.data is None:
            return {"source": "synthetic", "role": self.data_role}
        return {"source": "recordio", "role": self.data_role, **self.data.to_dict()}

    def settings(self) -> dict[str, Any]:
        """Every setting that changes a run's work or limits; a folder's runs all share them."""
        topo = self.cases[0].topology
        data = {} if self.data_role == "synthetic" else {"data": self.data_record()}
        if self.train is not None:
            data["train"] = self.train.to_dict()
        if self.align is not None:
            data["align"] = self.align.to_dict()
        return {"recipe": self.recipe, "framework": self.framework, **data,
                "workload": self.workload.to_dict(),
                "measure": self.measure.to_dict(), "tuning": self.tuning.to_dict(),
                "device": topo.device, "nnodes": topo.nnodes,
                "cases": [[c.topology.devices_per_node, c.batch_size] for c in self.cases]}


def plan_cases(devices: list[int], batch_sizes: list[int], base: Topology) -> list[Case]:
    """Every (batch, devices) pair, batches outermost so each batch's 1-device base runs first."""
    return [Case(replace(base, devices_per_node=d), b) for b in batch_sizes for d in devices]


def device_kind(device: str) -> str:
    """``cpu`` or ``cuda``: where a run asked for as ``auto``, ``cuda`` or ``cpu`` goes (auto: a
    GPU where this machine has one)."""
    if device == "auto":
        from .env import gpu_count

        return "cuda" if gpu_count() else "cpu"
    return device


def check_plan(plan: Plan) -> None:
    """ValueError, in one line, when the plan's backend does not run one of its cases (its
    declaration, ``Backend.capabilities``): refused before anything starts."""
    backend = get_backend(plan.framework)
    kind = device_kind(plan.cases[0].topology.device)
    for case in plan.cases:
        backend.check(plan.workload.replace(batch_size=case.batch_size), case.topology,
                      plan.tuning, kind, train=plan.train is not None,
                      real_data=plan.data is not None)
