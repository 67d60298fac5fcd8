"""How long a run may go without a step before it is stopped as hung (``--stall-timeout``).

A run that hangs would otherwise cost its whole ``--timeout`` (1,800 s by default), so a stall
limit is on by default, sized from the case's own step times:

- until a step of the case is known, ``FLOOR_S``, which a framework that compiles (again) at
  its second or third step fits under;
- once steps are known (earlier runs of the case, and this run's own steps so far),
  ``STEP_MULTIPLE`` times their median, never below the floor.

A run's first step is never among the known steps: it carries the start-up's one-off work
(compilation, autotuning, the allocator's growth), and the stall is counted only after it
anyway (``attempts``). ``Measure.stall_timeout_s`` fixes the limit instead and
``Measure.stall_auto`` False leaves only ``timeout_s``. A profiled run (``--breakdown``)
reports its steps together at its end, and a training run evaluates and checkpoints between
its steps for as long as its verification sets take: neither has a sized limit (a fixed one
still holds a training run). Standard library only.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable

from .config import STALL_FLOOR_S, Measure
from .protocol import Event, Step

__all__ = ["FLOOR_S", "STEP_MULTIPLE", "StallSizing", "limit_s", "steady_steps"]

FLOOR_S = STALL_FLOOR_S
"""The least a sized limit is (``Measure.stall_floor_s``'s default; ``config`` holds the figure
and where it comes from)."""
STEP_MULTIPLE = 20.0
"""A sized limit is this many median steps. Across the 558 runs of 4 steps or more recorded
under ``benchmarks/results`` (CPU and H200), the slowest step after a run's first was at most
4.8 times the run's median (``time_to_accuracy-cpu/pfc0.1-fp32``, a CPU shared with other
work); 20 leaves four times that."""


def limit_s(measure: Measure, known_step_s: Iterable[float]) -> float | None:
    """The stall limit a run is under, given the step times known of its case (each run's
    steps after its first): the fixed one, None where the stall is off, else the sized one
    (whole seconds, rounded up)."""
    if measure.stall_timeout_s is not None:
        return measure.stall_timeout_s
    if not measure.stall_auto:
        return None
    known = [s for s in known_step_s if s > 0]
    if not known:
        return measure.stall_floor_s
    return max(measure.stall_floor_s,
               float(math.ceil(STEP_MULTIPLE * statistics.median(known))))


def steady_steps(record: dict[str, Any]) -> list[float]:
    """A run record's step times after its first (warm-up and window alike)."""
    steps = list(record.get("warmup_step_times_s") or []) + list(record.get("step_times_s")
                                                                 or [])
    return steps[1:]


@dataclass
class StallSizing:
    """The stall limit of one launch as its steps come in: from the earlier runs' step times
    and this run's own (``saw``)."""

    measure: Measure
    known_s: list[float] = field(default_factory=list)
    """The case's step times after each run's first: earlier runs', then this run's."""
    sized: bool = True
    """False: no sized limit for this launch (a training run); a fixed one still holds."""

    def saw(self, events: Iterable[Event]) -> None:
        self.known_s.extend(e.seconds for e in events if isinstance(e, Step) and e.index > 0)

    def limit_s(self) -> float | None:
        if not self.sized and self.measure.stall_timeout_s is None:
            return None
        return limit_s(self.measure, self.known_s)
