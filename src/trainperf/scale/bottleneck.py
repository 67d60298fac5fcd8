"""What bounds a case, from its breakdown (``run --breakdown``): the FLOP/s each phase achieved,
the exposed communication against what a ``commbench`` fabric predicts for the gradient bytes,
and a verdict in words with the numbers behind it.

FLOPs are counted as the scaling model counts them (``model.Job``): the backbone's forward from
its layers on torch's meta device, its backward twice that, the head's class-matrix products
3 x 2 x samples x rows x D for a training step (a third of that for the forward alone).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from ..backends.phases import label
from ..report.breakdown import ms_text, rate_text, share_text
from .model import Scale, bucket_allreduce
from .project import fabric_from, job_from

INPUT_BOUND = 0.20
COMM_BOUND = 0.15
HEAD_BOUND = 0.35
"""Shares of the step above which a verdict names that phase as what bounds the case."""
PFC_RATIO = 0.1


def _job(doc: dict, case: dict):
    try:
        return job_from(doc, case["batch_size_per_device"])
    except (ValueError, KeyError, ImportError):
        return None  # a backbone trainperf cannot count: no rates, the times stand


def _flops(job, world: int, name: str, head_has_backward: bool | None) -> float | None:
    """FLOPs one device runs in phase ``name`` (parts joined with ``+`` add up)."""
    if job is None:
        return None
    fwd = job.backbone_fwd_flops * job.batch_size
    head = job.head_flops(world) if job.num_classes else 0.0
    head_in_head = head if head_has_backward else head / 3
    per = {"backbone_forward": fwd, "head": head_in_head,
           "backward": 2 * fwd + (head - head_in_head)}
    parts = name.split("+")
    if not any(p in per for p in parts):
        return None
    if "head" in parts and "backward" in parts:
        return fwd * ("backbone_forward" in parts) + 2 * fwd + head
    return sum(per.get(p, 0.0) for p in parts)


def fabric_of(paths: list[str] | None):
    if not paths:
        return None
    return fabric_from(None, None, 10.0, 30.0, paths)


def analyse(doc: dict, case: dict, fabric=None) -> dict[str, Any] | None:
    """Rates, prediction and verdict of one case's breakdown (None: the case has none)."""
    bd = case.get("breakdown")
    if not bd:
        return None
    if bd.get("status") != "ok" or not bd.get("phases_s"):
        return {"error": bd.get("error") or f"the profiled run {bd.get('status')}"}
    world = case["world_size"]
    job = _job(doc, case)
    times, shares = bd["phases_s"], bd["shares"]
    rates = {}
    for name, seconds in times.items():
        flops = _flops(job, world, name, bd.get("head_has_backward"))
        if flops and seconds > 0:
            rates[name] = flops / seconds
    timed_step = (world * case["batch_size_per_device"] / case["median_samples_per_s"]
                  if case.get("median_samples_per_s") else None)
    predicted = None
    if fabric is not None and job is not None and world > 1 and "backward" in times:
        try:
            # What the breakdown measures (the backward with the all-reduce less without it)
            # holds the CPU the all-reduce took from the backward too.
            ar = bucket_allreduce(job.gradient_bytes, job.bucket_bytes, times["backward"],
                                  Scale(case["nodes"], case["devices_per_node"]), fabric)
            predicted = ar.exposed_s + ar.stretch_s
        except ValueError:
            predicted = None
    out = {"rates": rates, "matmul": bd.get("matmul_flops_per_s"), "timed_step_s": timed_step,
           "predicted_comm_s": predicted, "job": job}
    out["verdict"] = verdict(doc, case, bd, out)
    return out


def verdict(doc: dict, case: dict, bd: dict, found: dict) -> str:
    """What bounds the case, in words, with the numbers behind it."""
    times, shares = bd["phases_s"], bd["shares"]
    world, job = case["world_size"], found["job"]
    if shares.get("data", 0.0) >= INPUT_BOUND:
        return (f"input-bound: {share_text(shares['data'])} of the step ({ms_text(times['data'])}) "
                "waiting for data")
    comm = shares.get("grad_comm", 0.0)
    if comm >= COMM_BOUND:
        text = (f"communication: {share_text(comm)} of the step ({ms_text(times['grad_comm'])}) is "
                f"gradient communication not hidden by compute at {world} ranks")
        if found["predicted_comm_s"] is not None:
            text += f"; the fabric predicts {ms_text(found['predicted_comm_s'])}"
        return text
    head = shares.get("head", 0.0)
    if head >= HEAD_BOUND and job is not None and job.num_classes:
        text = (f"bound by the head: {share_text(head)} of the step ({ms_text(times['head'])}) at "
                f"{job.num_classes:,} classes")
        if job.fc in ("dp", "mp") and bd.get("head_has_backward"):
            rows = job.computed_rows(world)
            pfc = replace(job, fc="pfc", sample_ratio=PFC_RATIO).computed_rows(world)
            head_pfc = times["head"] * pfc / rows
            step = bd["step_s"] - times["head"] + head_pfc
            text += (f"; `pfc {PFC_RATIO}` would cut the head to about {ms_text(head_pfc)} and the "
                     f"step from {ms_text(bd['step_s'])} to about {ms_text(step)} (the measured "
                     f"{1e6 * times['head'] / rows:.2f} us per class row, {pfc:,.0f} rows "
                     f"instead of {rows:,.0f})")
        return text
    merged = [n for n in times if "+" in n]
    if merged:
        name = merged[0]
        text = (f"not split: {bd['merged'].get(name, 'one program')}; {share_text(shares[name])} of "
                "the step runs in it")
        rate = found["rates"].get(name)
        if rate and found["matmul"]:
            text += f", at {share_text(rate / found['matmul'])} of the measured matmul rate"
        return text
    compute = [n for n in ("backbone_forward", "backward") if n in times]
    text = "compute-bound in the backbone: " + ", ".join(
        f"{label(n)} {share_text(shares[n])}" for n in compute) + " of the step"
    rates = [found["rates"][n] for n in compute if n in found["rates"]]
    if rates and found["matmul"]:
        low, high = (share_text(r / found["matmul"]) for r in (min(rates), max(rates)))
        text += f", at {low if low == high else f'{low}-{high}'} of the measured matmul rate"
    return text




def analyser(fabric_paths: list[str] | None = None) -> Callable[[dict, dict], dict | None]:
    """``analyse`` for ``report.assemble.write_report``, against the fabric of these commbench
    results (None: no prediction)."""
    fabric = fabric_of(fabric_paths)
    return lambda doc, case: analyse(doc, case, fabric)
