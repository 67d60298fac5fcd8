"""A case's step broken into phases, from its profiled run's ``phases`` event (standard library
only: the runner writes it into ``results.json``).

Each phase's figure is its median over the profiled steps, so the phases add up to the median
step only approximately: ``sum_s`` lies within the range of the profiled steps' times
(``step_s_range``) up to how the phases vary from step to step. Steps run without the
gradient all-reduce (``phases.NO_COMM``) do not count as steps: the median backward of the
normal steps less theirs is the communication the backward does not hide, which moves from
``backward`` to ``grad_comm``.
"""

from __future__ import annotations

import statistics
from typing import Any

from .backends.phases import LABELS, NO_COMM, PHASES


def _order(name: str) -> int:
    return PHASES.index(name.split("+")[0])


def summarize(phases: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """The breakdown of one case from its profiled run: ``phases`` is the run's ``phases``
    event (as a dict; empty where the run wrote none) and ``record`` its run record."""
    out: dict[str, Any] = {"status": record["status"], "error": record.get("error"),
                           "method": phases.get("method"), "merged": phases.get("merged") or {},
                           "head_has_backward": phases.get("head_has_backward")}
    steps = phases.get("steps") or []
    normal = [s for s in steps if s.get("variant", "") == ""]
    quiet = [s for s in steps if s.get("variant") == NO_COMM]
    if not normal:
        if record["status"] == "ok":
            out["status"] = "failed"
            out["error"] = "the profiled run wrote no phases"
        return out
    names = sorted({n for s in normal for n in s["phases"]}, key=_order)
    medians = {n: statistics.median(s["phases"].get(n, 0.0) for s in normal) for n in names}
    exposed = None
    if quiet and "backward" in medians:
        alone = statistics.median(s["phases"].get("backward", 0.0) for s in quiet)
        exposed = max(0.0, medians["backward"] - alone)
        medians["backward"] -= exposed
        medians["grad_comm"] = medians.get("grad_comm", 0.0) + exposed
        names = sorted(set(names) | {"grad_comm"}, key=_order)
    step_s = statistics.median(s["seconds"] for s in normal)
    step_range = [min(s["seconds"] for s in normal), max(s["seconds"] for s in normal)]
    ordered = {n: medians[n] for n in names}
    out.update({
        "steps": len(normal), "no_comm_steps": len(quiet), "step_s": step_s,
        "step_s_range": step_range,
        "phases_s": ordered,
        "shares": {n: v / step_s for n, v in ordered.items()} if step_s > 0 else {},
        "sum_s": sum(ordered.values()),
        "hidden_comm_measured": exposed is not None,
        "matmul_flops_per_s": phases.get("matmul_flops_per_s"),
        "matmul_what": phases.get("matmul_what"),
        "collectives": phases.get("collectives"),
        "trace": phases.get("trace"), "trace_open": phases.get("trace_open"),
    })
    return out

