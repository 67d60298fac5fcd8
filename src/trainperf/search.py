"""Capacity searches: the largest batch per device, or the largest number of classes, that
trains. Grow until a probe fails, then bisect. Every probe is a fresh run (its own process tree,
through the same runner), so a crash or an out-of-memory cannot poison the next; a probe fits
only if it completes all its training steps.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from . import results
from .progress import NullProgress
from .runner import Plan, Runner

KINDS = {"max-batch": "batch_size", "max-classes": "num_classes"}
# Growth stops here even without a failure: a search must end.
CEILINGS = {"max-batch": 1 << 16, "max-classes": 1 << 30}


@dataclass
class Probe:
    value: int
    status: str
    peak_memory_bytes: int | None
    predicted_peak_bytes: int | None
    error: str | None
    results_dir: str

    @property
    def fits(self) -> bool:
        return self.status == "ok"


@dataclass
class SearchOutcome:
    kind: str
    recipe: str
    answer: int | None
    largest_fit: int | None
    smallest_fail: int | None
    step: int
    probes: list[Probe] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def probe_at(self, value: int | None) -> Probe | None:
        return next((p for p in self.probes if p.value == value), None)

    def to_dict(self) -> dict:
        at = self.probe_at(self.answer)
        return {"schema": "trainperf.search/v1", "kind": self.kind, "recipe": self.recipe,
                "answer": self.answer, "largest_fit": self.largest_fit,
                "smallest_fail": self.smallest_fail, "resolution_step": self.step,
                "peak_memory_bytes_at_answer": at.peak_memory_bytes if at else None,
                "predicted_peak_bytes_at_answer": at.predicted_peak_bytes if at else None,
                "settings": self.settings, "probes": [asdict(p) for p in self.probes]}


def step_for(value: int, resolution: float) -> int:
    """How close the fitting and the failing value must come before the search stops."""
    return max(1, math.ceil(value * resolution)) if resolution > 0 else 1


def next_guess(fits: list[Probe], limit_bytes: int | None, ceiling: int) -> int:
    """The next value to try upward. With a known memory limit: from two fitting probes, a
    little under where their measured peaks extrapolate to the limit; from one, the value
    scaled by the limit over its peak (an underestimate, as part of the peak does not grow with
    the value, so the next probe still fits and gives the second point). Otherwise double."""
    lo = max(p.value for p in fits)
    guess = 2 * lo
    measured = sorted((p.value, p.peak_memory_bytes) for p in fits if p.peak_memory_bytes)
    if limit_bytes and len(measured) >= 2:
        (v1, m1), (v2, m2) = measured[-2], measured[-1]
        if v2 > v1 and m2 > m1:
            slope = (m2 - m1) / (v2 - v1)
            target = v2 + 0.97 * (limit_bytes - m2) / slope
            guess = int(min(max(target, 1.25 * lo), 4 * lo))
    elif limit_bytes and measured and measured[-1][0] == lo and measured[-1][1] < limit_bytes:
        target = lo * 0.97 * limit_bytes / measured[-1][1]
        guess = int(min(max(target, 1.25 * lo), 4 * lo))
    return min(guess, ceiling)


def run_search(kind: str, plan: Plan, start: int, resolution: float, max_probes: int,
               limit_bytes: int | None = None,
               on_probe: Callable[[Probe], None] = lambda _: None) -> SearchOutcome:
    if kind not in KINDS:
        raise ValueError(f"search kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if start < 1:
        raise ValueError(f"--start must be >= 1, got {start}")
    field_name = KINDS[kind]
    outcome = SearchOutcome(kind, plan.recipe, None, None, None, 1)

    def probe(value: int) -> Probe:
        existing = outcome.probe_at(value)
        if existing:
            return existing
        workload = plan.workload.replace(**{field_name: value})
        case = plan.cases[0]
        if field_name == "batch_size":
            case = replace(case, batch_size=value)
        out = plan.out_dir / "probes" / f"{field_name}-{value}"
        doc = Runner(replace(plan, workload=workload, cases=[case], out_dir=out),
                     NullProgress()).run()
        run = doc["cases"][0]["runs"][0]
        p = Probe(value, run["status"], run["peak_memory_bytes"], run.get("predicted_peak_bytes"),
                  run["error"], str(out))
        outcome.probes.append(p)
        on_probe(p)
        return p

    lo: int | None = None
    hi: int | None = None
    value = start
    ceiling = CEILINGS[kind]
    while len(outcome.probes) < max_probes:
        if probe(value).fits:
            lo = value
            if hi is not None or value >= ceiling:
                break
            value = next_guess([p for p in outcome.probes if p.fits], limit_bytes, ceiling)
        else:
            hi = value
            if lo is not None:
                break
            if value == 1:
                break  # not even one fits
            value = max(1, value // 2)
    # Bisect between the largest fit and the smallest failure.
    while lo is not None and hi is not None and len(outcome.probes) < max_probes:
        if hi - lo <= step_for(lo, resolution):
            break
        mid = (lo + hi) // 2
        if probe(mid).fits:
            lo = mid
        else:
            hi = mid
    outcome.largest_fit = lo
    outcome.smallest_fail = hi
    outcome.step = step_for(lo or 1, resolution)
    outcome.answer = lo
    return outcome


def default_resolution(kind: str) -> float:
    """Exact for the batch; 1% for classes, where one more class changes nothing measurable."""
    return 0.0 if kind == "max-batch" else 0.01


def search_settings(plan: Plan, start: int, resolution: float) -> dict:
    """What a search held fixed, kept in search.json beside its answer."""
    topo = plan.cases[0].topology
    w = plan.workload
    return {"devices_per_node": topo.devices_per_node, "nnodes": topo.nnodes,
            "world_size": topo.world_size, "device": topo.device, "fc": w.fc,
            "sample_ratio": w.sample_ratio, "precision": w.precision,
            "batch_size": w.batch_size, "num_classes": w.num_classes,
            "memory_limit_bytes": plan.measure.memory_limit_bytes, "resolution": resolution,
            "iters": plan.measure.iters, "start": start, "tuning": plan.tuning.to_dict()}


def prepare(kind: str, plan: Plan, start: int | None, resolution: float | None
            ) -> tuple[int, float, dict]:
    """A search's first value and resolution (None: the plan's value, the kind's default) and
    the settings it keeps; ValueError when the plan's folder already holds a search."""
    if (plan.out_dir / "search.json").exists():
        raise ValueError(f"{plan.out_dir} already holds a search; choose another --out")
    start = start or getattr(plan.workload, KINDS[kind])
    resolution = resolution if resolution is not None else default_resolution(kind)
    return start, resolution, search_settings(plan, start, resolution)


def write_outcome(outcome: SearchOutcome, out_dir: Path) -> Path:
    path = out_dir / "search.json"
    results.write_json_atomic(path, outcome.to_dict())
    return path
