"""``--mode best`` for a runner: which modes a plan's probe tries (those every case of the plan
can run), its rounds on the plan's first case, the choice (``mode_choice``) made once per plan
and shared with the plans that must run in the same mode (a real-data plan and its synthetic
twin), and, on several nodes, made by node 0 alone and taken by the others. Imports no
framework."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from . import mode_choice, outcome
from .backends.base import Backend
from .config import MODE_BEST
from .node_agreement import Nodes
from .plan_model import Case, Plan, device_kind
from .protocol import Event, Start, Step
from .rendezvous import RendezvousError
from .run_kinds import ProbeRound

RunRound = Callable[[Case, ProbeRound], tuple[dict, list[Event]]]
"""Launch one probe round of a case: (the run's record, the events it saw)."""


@dataclass
class SharedChoice:
    """One mode decision for the plans of one mode group (``Plan.mode_group``)."""

    probe: dict[str, Any] | None = None
    probed_in: str | None = None
    """The folder of the plan whose probe made it."""


def candidate_modes(plan: Plan, backend: Backend) -> tuple[list[str], dict[str, str]]:
    """(the framework's modes on the plan's device, in declared order; {mode: why} for each
    mode some case of the plan cannot run)."""
    kind = device_kind(plan.cases[0].topology.device)
    modes = list(backend.modes_on(kind))
    refused: dict[str, str] = {}
    for mode in modes:
        for case in plan.cases:
            why = backend.refusal(plan.workload.replace(batch_size=case.batch_size),
                                  case.topology, replace(plan.tuning, mode=mode), kind,
                                  train=plan.train is not None, real_data=plan.data is not None)
            if why:
                refused[mode] = f"{case.key.name} b{case.batch_size}: {why}"
                break
    return modes, refused


def round_record(kind: ProbeRound, record: dict, seen: list[Event],
                 measure_warmup: int, timed_steps: int, wall_s: float) -> dict[str, Any]:
    """One probe round as the probe keeps it: its status and flags, and its rate over the
    steps after compilation settled (``mode_choice.round_figures``)."""
    start = next((e for e in seen if isinstance(e, Start)), None)
    steps = [{"index": e.index, "seconds": e.seconds, "compiles": e.compiles}
             for e in seen if isinstance(e, Step)]
    samples = (start.global_batch if start else
               next((e.samples for e in seen if isinstance(e, Step)), None))
    figures = (mode_choice.round_figures(steps, measure_warmup, timed_steps, samples)
               if record["status"] == "ok" else {})
    return {"mode": kind.probe_mode, "round": kind.round_, "status": record["status"],
            "error": outcome.one_line(record.get("error")), "flags": record["flags"],
            "wall_s": wall_s, "samples_per_s": figures.get("samples_per_s"),
            **{k: v for k, v in figures.items() if k != "samples_per_s"}}


class PlanModes:
    """The mode a plan's timed runs go in: its fixed mode, or under ``--mode best`` the one its
    probe (or its group's) chose."""

    def __init__(self, plan: Plan, backend: Backend, shared: SharedChoice | None) -> None:
        self.plan, self.backend = plan, backend
        self.shared = shared or SharedChoice()
        decided = plan.decided_mode
        if decided is not None and self.best and self.shared.probe is None:
            self.shared.probe = dict(decided)
            self.shared.probed_in = decided.get("probed_in")

    @property
    def best(self) -> bool:
        return self.plan.tuning.mode == MODE_BEST

    @property
    def probe(self) -> dict[str, Any] | None:
        return self.shared.probe

    def pending(self) -> bool:
        return self.best and self.shared.probe is None

    def mode(self) -> str:
        """The mode of the plan's timed runs (``default`` resolves in the worker)."""
        if not self.best:
            return self.plan.tuning.mode
        assert self.shared.probe is not None, "the probe decides before the first timed run"
        return self.shared.probe["chosen"]

    def not_timed(self) -> str | None:
        """Why none of the plan's runs can be timed: its probe saw every mode fail, the
        default's own rounds among them."""
        probe = self.shared.probe
        if self.best and probe is not None and probe["chosen"] is None:
            return f"not timed: --mode best found no mode to time ({probe['why']})"
        return None

    def restore(self, probe: dict[str, Any]) -> None:
        """A decision an earlier run of this folder recorded."""
        if self.shared.probe is not None and self.shared.probe["chosen"] != probe["chosen"]:
            raise ValueError(f"{self.plan.out_dir} ran in {probe['chosen']} while "
                             f"{self.shared.probed_in} chose {self.shared.probe['chosen']}: "
                             "plans that share a mode cannot be resumed apart")
        if self.shared.probe is None:
            self.shared.probe, self.shared.probed_in = probe, str(self.plan.out_dir)

    def run_probe(self, run_round: RunRound, nodes: Nodes) -> Iterator[None]:
        """The probe's rounds on the plan's first case (a turn each), then one decision, on
        every node alike."""
        case = self.plan.cases[0]
        modes, refused = candidate_modes(self.plan, self.backend)
        probed = [m for m in modes if m not in refused]
        rounds: list[dict[str, Any]] = []
        began = time.monotonic()
        if len(probed) > 1:
            settle, steps = mode_choice.probe_shape(self.plan.measure.warmup,
                                                    self.plan.measure.window_steps)
            for round_, mode in mode_choice.probe_order(probed):
                kind = ProbeRound(mode, round_)
                t0 = time.monotonic()
                record, seen = run_round(case, kind)
                rounds.append(round_record(kind, record, seen, settle, steps,
                                           time.monotonic() - t0))
                yield
        wall_s = time.monotonic() - began

        def decide() -> dict[str, Any]:
            probe = mode_choice.choose(modes, rounds, refused)
            probe.update(case=f"{case.key.name} b{case.batch_size}", wall_s=wall_s,
                         settle_max=None, timed_steps=None)
            if len(probed) > 1:
                probe["settle_max"], probe["timed_steps"] = mode_choice.probe_shape(
                    self.plan.measure.warmup, self.plan.measure.window_steps)
            return probe

        topo = case.topology
        try:
            probe = (nodes.one_decision(topo, "mode_probe", decide) if topo.nnodes > 1
                     else decide())
        except RendezvousError as exc:
            # No run can go on without the other nodes: each fails at its meeting, saying so.
            probe = {**decide(), "why": f"the nodes lost each other before agreeing on a mode "
                                        f"({exc})"}
        self.shared.probe, self.shared.probed_in = probe, str(self.plan.out_dir)

    def record(self) -> dict[str, Any] | None:
        """The decision as this plan's results keep it: where another plan of its group made
        it, that plan's folder says so."""
        if self.shared.probe is None:
            return None
        probe = dict(self.shared.probe)
        if self.shared.probed_in and Path(self.shared.probed_in) != Path(self.plan.out_dir):
            # A probe of another run (``--mode-from``) names its folder in full.
            probe.setdefault("probed_in", Path(self.shared.probed_in).name)
        return probe
