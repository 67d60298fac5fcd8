"""What one launch of a case is for: a timed run (one of the case's statistics), a round of the
mode probe (``--mode best``, kept apart), or the profiled run (``--breakdown``, kept apart).
Each kind says its folder, its label, its event tags, its steps and its mode, so that the
runner launches every kind one way. Imports no framework."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from . import mode_choice
from .config import Measure, ProfileSpec


@dataclass(frozen=True)
class TimedRun:
    """Run ``run`` of a case: its measure as the plan has it, in the plan's mode."""

    run: int
    trains = True
    """A training plan's timed run trains (to its target, with its evaluations)."""

    @property
    def name(self) -> str:
        return f"run{self.run}"

    @property
    def label(self) -> str:
        return f"run {self.run}"

    def tags(self) -> dict:
        return {}

    def measure(self, plan_measure: Measure) -> Measure:
        return plan_measure

    def mode(self, plan_mode: Callable[[], str]) -> str:
        return plan_mode()

    def profile(self, run_dir: Path) -> ProfileSpec | None:
        return None


@dataclass(frozen=True)
class ProbeRound:
    """Round ``round_`` (0-based) of the mode probe, in ``mode``: a short run whose timed steps
    start where compilation settled (``mode_choice.probe_shape``)."""

    probe_mode: str
    round_: int
    trains = False
    """A round times steps only, a training plan's too: its step on its data, never a training
    to the target with evaluations and checkpoints."""

    @property
    def run(self) -> int:
        return self.round_ + 1

    @property
    def name(self) -> str:
        return f"probe-{self.probe_mode}-{self.run}"

    @property
    def label(self) -> str:
        return f"probe {self.probe_mode} {self.run}"

    def tags(self) -> dict:
        return {"probe": self.probe_mode}

    def measure(self, plan_measure: Measure) -> Measure:
        settle, steps = mode_choice.probe_shape(plan_measure.warmup, plan_measure.window_steps)
        return replace(plan_measure, runs=1, iters=settle + steps, warmup=settle)

    def mode(self, plan_mode: Callable[[], str]) -> str:
        return self.probe_mode

    def profile(self, run_dir: Path) -> ProfileSpec | None:
        return None


@dataclass(frozen=True)
class ProfiledRun:
    """The case's profiled run (``--breakdown``): the plan's warm-up, then ``steps`` steps
    split into phases; with ``trace``, the framework's trace in the run's folder."""

    steps: int
    trace: bool = False
    run: int = 0
    trains = False
    """Phases of the step, split over ``steps`` steps: no training to a target."""

    @property
    def name(self) -> str:
        return "profile"

    @property
    def label(self) -> str:
        return "profile"

    def tags(self) -> dict:
        return {"profile": True}

    def measure(self, plan_measure: Measure) -> Measure:
        return replace(plan_measure, runs=1, iters=plan_measure.warmup + self.steps)

    def mode(self, plan_mode: Callable[[], str]) -> str:
        return plan_mode()

    def profile(self, run_dir: Path) -> ProfileSpec | None:
        return ProfileSpec(self.steps, str((run_dir / "trace").resolve()) if self.trace
                           else None)


RunKind = TimedRun | ProbeRound | ProfiledRun
