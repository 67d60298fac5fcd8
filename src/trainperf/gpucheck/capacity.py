"""Capacity (part 3): the largest batch and the most classes one device holds (the seeds'
"max bsz" and "max num_classes" columns), each with the memory model's error, and a refit of
the model's constants for this kind of device from every probe that fitted.

Both searches are ``trainperf search``'s own (grow, then bisect; every probe a fresh run). On a
GPU they start a little under where the memory model puts the device's memory, so a borrowed
machine's minutes go to the bracket, not to the approach. The CPU mode caps each process's
memory instead (``--memory-limit``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from ..backends.torch.memory_model import DeviceConstants, combine, constants_for, estimate
from ..config import Measure
from ..recipes import get_recipe
from ..search import KINDS, run_search, search_settings, write_outcome
from . import cases
from .record import StageLog
from .runs import plan_for

SEARCHES = {
    "gpu": [("max-batch", cases.Case("R100 emore mp fp32", "r100-arcface-emore",
                                     {"fc": "mp", "precision": "fp32"})),
            ("max-classes", cases.Case("R100 pfc 0.1 fp16 b64", "r100-arcface-emore",
                                       {"fc": "pfc", "sample_ratio": 0.1,
                                        "precision": "fp16"}))],
    "cpu": [("max-batch", cases.Case("tiny mp fp32", "tiny-arcface",
                                     {"fc": "mp", "precision": "fp32"})),
            ("max-classes", cases.Case("tiny pfc 0.1 fp16", "tiny-arcface",
                                       {"fc": "pfc", "sample_ratio": 0.1,
                                        "precision": "fp16"}))],
}
CPU_LIMITS = {"max-batch": 700 * 2**20, "max-classes": 800 * 2**20}
CPU_STARTS = {"max-batch": 32, "max-classes": 400_000}
RESOLUTION = {"gpu": 0.05, "cpu": 0.5}
"""5% on a GPU: each probe is a fresh process (and cuDNN's autotuning at a new batch size), and
two searches share the stage's minutes; the bracket says where the limit lies either way. The
CPU mode's bracket only has to exist (each probe is a process in the suite's time; the search's
bisection to a finer step is tests/test_search.py's)."""
MAX_PROBES = {"gpu": 6, "cpu": 5}
PROBE_MEASURE = Measure(runs=1, iters=6, warmup=2, timeout_s=180)
AIM = 0.9
"""The first probe on a GPU: this fraction of the value the model says fills the device."""


def model_start(kind: str, case: cases.Case, limit_bytes: int) -> int:
    """``AIM`` times the largest value the memory model (with its GPU constants) fits in
    ``limit_bytes``. Found by doubling and bisection: the prediction grows with the value but
    not along one line (the head's step term overtakes the backbone's backward at some class
    count)."""
    field = KINDS[kind]
    workload = get_recipe(case.recipe).workload.replace(**case.changes)

    def fits(value: int) -> bool:
        # The elastic workspace takes what is free and never decides a fit.
        return estimate(workload.replace(**{field: value}), 1, device_type="cuda",
                        limit_bytes=limit_bytes).total_bytes <= limit_bytes

    lo, hi = 0, getattr(workload, field)
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > max(1, lo // 200):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return max(1, int(AIM * lo))


def device_memory_bytes() -> int:
    """The device's memory, asked in a process of its own: a CUDA context kept here would hold
    memory away from every probe."""
    out = subprocess.run([sys.executable, "-c",
                          "import torch; print(torch.cuda.mem_get_info()[1])"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def calibration_points(probe_dirs: list[str]) -> list[dict]:
    """(model components, baseline, measured peak) of every probe that trained."""
    points = []
    for folder in probe_dirs:
        try:
            doc = json.loads((Path(folder) / "results.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        for c in doc.get("cases", []):
            for r in c["runs"]:
                if r["status"] == "ok" and r.get("peak_memory_bytes") and c.get("memory_model"):
                    points.append({"parts": c["memory_model"], "precision": c["precision"],
                                   "baseline": r.get("baseline_memory_bytes") or 0,
                                   "peak": r["peak_memory_bytes"], "probe": folder})
    return points


def model_error(points: list[dict], constants: DeviceConstants) -> float | None:
    """Mean |predicted - measured| / measured over the points."""
    if not points:
        return None
    errors = [abs(p["baseline"] + combine(p["parts"], constants) - p["peak"]) / p["peak"]
              for p in points]
    return sum(errors) / len(errors)


def fit(points: list[dict]) -> DeviceConstants | None:
    """The backward factor (a grid of 0.01 from 1 to 4) and runtime bytes (the median of what
    is left, never negative) that fit the points best by mean relative error."""
    if len(points) < 2:
        return None
    best, best_error = None, float("inf")
    for step in range(0, 301):
        factor = 1.0 + step / 100
        left = sorted(p["peak"] - p["baseline"] - combine(p["parts"], DeviceConstants(
            factor, 0, "")) for p in points)
        runtime = max(0, int(left[len(left) // 2]))
        candidate = DeviceConstants(factor, runtime, f"refitted to {len(points)} probes")
        error = model_error(points, candidate)
        if error < best_error - 1e-12:
            best, best_error = candidate, error
    return best


def leave_one_out(points: list[dict]) -> float | None:
    """The refit's error on each point when that point is left out of the fit: how well it
    predicts a probe it has not seen."""
    if len(points) < 3:
        return None
    errors = []
    for i, p in enumerate(points):
        fitted = fit(points[:i] + points[i + 1:])
        errors.append(model_error([p], fitted))
    return sum(errors) / len(errors)


def search(log: StageLog, mode: str, work: Path, kind: str, case: cases.Case,
           device_bytes: int | None) -> list[str]:
    device = cases.device(mode)
    if mode == "gpu":
        limit = device_bytes
        start = model_start(kind, case, limit)
        measure = PROBE_MEASURE
    else:
        limit = CPU_LIMITS[kind]
        start = CPU_STARTS[kind]
        measure = replace(PROBE_MEASURE, iters=4, warmup=1, memory_limit_bytes=limit)
    plan = plan_for(case, work, measure, device, folder=f"search-{kind}")
    def on_probe(p) -> None:
        # Kept as it comes: a stage stopped at its cap still shows the probes it made.
        log.add("probe", search=kind, value=p.value, status=p.status,
                peak_bytes=p.peak_memory_bytes, predicted_bytes=p.predicted_peak_bytes,
                error=(p.error or "")[:200] or None)
        print(f"{kind} probe {p.value}: {p.status}", flush=True)

    outcome = run_search(kind, plan, start, RESOLUTION[mode], MAX_PROBES[mode], limit,
                         on_probe)
    outcome.settings = search_settings(plan, start, RESOLUTION[mode])
    write_outcome(outcome, plan.out_dir)
    d = outcome.to_dict()
    peak, predicted = d["peak_memory_bytes_at_answer"], d["predicted_peak_bytes_at_answer"]
    log.add("search", search=kind, label=case.label, answer=d["answer"],
            largest_fit=d["largest_fit"], smallest_fail=d["smallest_fail"], start=start,
            resolution=RESOLUTION[mode], limit_bytes=limit,
            peak_bytes_at_answer=peak, predicted_bytes_at_answer=predicted,
            model_error_at_answer=(predicted - peak) / peak if peak and predicted else None,
            probes=[{"value": p["value"], "status": p["status"],
                     "peak_bytes": p["peak_memory_bytes"],
                     "predicted_bytes": p["predicted_peak_bytes"],
                     "error": (p["error"] or "")[:200] or None} for p in d["probes"]],
            results_dir=str(plan.out_dir))
    return [p["results_dir"] for p in d["probes"]]


def run(log: StageLog, mode: str, work: Path) -> None:
    device_bytes = device_memory_bytes() if mode == "gpu" else None
    log.set(device_memory_bytes=device_bytes)
    probe_dirs: list[str] = []
    for kind, case in SEARCHES[mode]:
        probe_dirs += search(log, mode, work, kind, case, device_bytes)
    refit(log, "cuda" if mode == "gpu" else "cpu", calibration_points(probe_dirs))


def committed_error(points: list[dict], device_type: str) -> float | None:
    """Mean |predicted - measured| / measured under the committed constants, each point in its
    own precision's."""
    if not points:
        return None
    return sum(model_error([p], constants_for(device_type, p["precision"]))
               for p in points) / len(points)


def refit(log: StageLog, device_type: str, points: list[dict]) -> None:
    old = constants_for(device_type)
    new = fit(points)
    log.add("refit", device_type=device_type, points=len(points),
            old={"backward_factor": old.backward_factor, "runtime_bytes": old.runtime_bytes,
                 "source": old.source},
            new=None if new is None else {"backward_factor": new.backward_factor,
                                          "runtime_bytes": new.runtime_bytes},
            old_error=committed_error(points, device_type),
            new_error=model_error(points, new) if new else None,
            new_error_left_out=leave_one_out(points))
