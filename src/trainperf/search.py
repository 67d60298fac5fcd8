"""Capacity searches: the largest batch per device, or the largest number of classes, that
trains. Grow until a probe runs out of memory, then bisect. Every probe is a fresh run (its own
process tree, through the same runner), so a crash or an out-of-memory cannot poison the next; a
probe fits only if it completes all its training steps, and only an out-of-memory (``oom``,
each framework's own, ``outcome``) says that a value does not fit. Any other end (a crash, a
usage failure, a hang) is no capacity: the search ends there, on a failure.

One search per (framework, devices) case of the plans (``search_plans``): a capacity is asked
per framework and per device count.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

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

    @property
    def out_of_memory(self) -> bool:
        return self.status == "oom"


def last_line(error: str | None) -> str:
    """An error's last line that says something (where allocators and exceptions put what
    went wrong)."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    return lines[-1] if lines else "no error recorded"


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
    limited_by: dict[str, Any] = field(default_factory=dict)
    """What ended the search (``limit_of``): ``out_of_memory`` at ``value``, the ``ceiling``
    (``CEILINGS``), ``max_probes``, or a ``failure`` (a probe's ``value``, ``status`` and the
    last line of its ``error``), which leaves no answer."""

    @property
    def failure(self) -> Probe | None:
        """The probe that ended the search on a failure, not a capacity; None where none did."""
        return next((p for p in self.probes if not (p.fits or p.out_of_memory)), None)

    def failure_line(self) -> str | None:
        """The failure in one line: the probe's value, its status and its error's last line."""
        p = self.failure
        if p is None:
            return None
        return (f"ended on a failure, not a capacity: probe {KINDS[self.kind]}={p.value} "
                f"{p.status}: {last_line(p.error)}")

    def probe_at(self, value: int | None) -> Probe | None:
        return next((p for p in self.probes if p.value == value), None)

    def to_dict(self) -> dict:
        at = self.probe_at(self.answer)
        return {"schema": "trainperf.search/v1", "kind": self.kind, "recipe": self.recipe,
                "answer": self.answer, "largest_fit": self.largest_fit,
                "smallest_fail": self.smallest_fail, "resolution_step": self.step,
                "peak_memory_bytes_at_answer": at.peak_memory_bytes if at else None,
                "predicted_peak_bytes_at_answer": at.predicted_peak_bytes if at else None,
                "limited_by": self.limited_by,
                "settings": self.settings, "probes": [asdict(p) for p in self.probes]}


def step_for(value: int, resolution: float) -> int:
    """How close the largest fitting value and the smallest out of memory must come before
    the search stops."""
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
        p = probe(value)
        if p.fits:
            lo = value
            if hi is not None or value >= ceiling:
                break
            value = next_guess([p for p in outcome.probes if p.fits], limit_bytes, ceiling)
        elif p.out_of_memory:
            hi = value
            if lo is not None:
                break
            if value == 1:
                break  # not even one fits
            value = max(1, value // 2)
        else:
            break  # not a capacity: nothing after it would be one either
    # Bisect between the largest fit and the smallest value out of memory.
    while (lo is not None and hi is not None and outcome.failure is None
           and len(outcome.probes) < max_probes):
        if hi - lo <= step_for(lo, resolution):
            break
        mid = (lo + hi) // 2
        p = probe(mid)
        if p.fits:
            lo = mid
        elif p.out_of_memory:
            hi = mid
    outcome.largest_fit = lo
    outcome.smallest_fail = hi
    outcome.step = step_for(lo or 1, resolution)
    outcome.answer = lo if outcome.failure is None else None
    outcome.limited_by = limit_of(outcome, ceiling, max_probes)
    return outcome


def limit_of(outcome: SearchOutcome, ceiling: int, max_probes: int) -> dict[str, Any]:
    """What ended a finished search (``SearchOutcome.limited_by``)."""
    failed = outcome.failure
    if failed is not None:
        return {"reason": "failure", "value": failed.value, "status": failed.status,
                "error": last_line(failed.error)}
    lo, hi = outcome.largest_fit, outcome.smallest_fail
    if lo is not None and lo >= ceiling:
        return {"reason": "ceiling", "value": ceiling}
    if hi is not None and (hi == 1 if lo is None else hi - lo <= outcome.step):
        return {"reason": "out_of_memory", "value": hi}
    return {"reason": "max_probes", "value": max_probes}


def default_resolution(kind: str) -> float:
    """Exact for the batch; 1% for classes, where one more class changes nothing measurable."""
    return 0.0 if kind == "max-batch" else 0.01


def search_settings(plan: Plan, start: int, resolution: float) -> dict:
    """What a search held fixed, kept in search.json beside its answer."""
    topo = plan.cases[0].topology
    w = plan.workload
    return {"framework": plan.framework, "devices_per_node": topo.devices_per_node,
            "nnodes": topo.nnodes,
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


def search_plans(kind: str, plans: list[Plan], root: Path) -> list[Plan]:
    """One plan per search: each of ``plans`` (one per framework and sweep point, as ``run``
    makes them) split into its cases (a device count, and for max-classes a batch), each in a
    folder of its own under ``root``, named as ``run`` names its plans' folders with the case's
    words after them (``torch-1n2g``); one search writes into ``root`` itself. ValueError where
    the plans sweep the value searched for."""
    field_name = KINDS[kind]
    batches = {c.batch_size for p in plans for c in p.cases}
    if kind == "max-batch" and len(batches) > 1:
        raise ValueError("search max-batch finds the batch: give one --batch-size (its first "
                         "probe) or --start, not a list")
    if kind == "max-classes" and len({p.workload.num_classes for p in plans}) > 1:
        raise ValueError("search max-classes finds the class count: give one --num-classes "
                         "(its first probe) or --start, not a list")
    devices = {c.topology.devices_per_node for p in plans for c in p.cases}
    out = []
    for plan in plans:
        words = [] if plan.out_dir == root else [plan.out_dir.relative_to(root).as_posix()]
        for case in plan.cases:
            parts = words + ([case.key.name] if len(devices) > 1 else []) + (
                [f"b{case.batch_size}"] if len(batches) > 1 else [])
            workload = plan.workload.replace(batch_size=case.batch_size)
            out.append(replace(plan, workload=workload, cases=[case],
                               out_dir=root / "-".join(parts) if parts else root))
    assert len({p.out_dir for p in out}) == len(out), f"two {field_name} searches in one folder"
    return out


def write_outcome(outcome: SearchOutcome, out_dir: Path) -> Path:
    path = out_dir / "search.json"
    results.write_json_atomic(path, outcome.to_dict())
    return path
