"""``trainperf project``: throughput at larger scales from a measured results.json and the
scaling model (``trainperf.scale.model``), with the fabric from commbench results or given
bandwidths."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .model import (
    MIB, Fabric, Job, Prediction, Scale, backbone_counts, fabric_from_commbench, parse_scales,
    project, uniform_fabric)

SCHEMA = "trainperf.project/v1"


def results_paths(text: str) -> list[Path]:
    """Every plan's results.json that ``text`` names or holds, as a command wrote it (one
    plan's folder, several frameworks', a job's); ValueError in one line where none."""
    from ..result_files import plan_documents

    found = plan_documents(text)
    if not found:
        raise ValueError(f"{text}: no results.json in it or below it" if Path(text).exists()
                         else f"{text}: no such file or folder")
    return found


def pick_base(doc: dict, base: str | None, batch: int | None) -> dict:
    """The measured case to start from (see --base)."""
    cases = [c for c in doc["cases"] if c.get("median_samples_per_s")]
    if batch is not None:
        cases = [c for c in cases if c["batch_size_per_device"] == batch]
    if base is not None:
        scale = parse_scales(base)[0]
        found = [c for c in cases if c["nodes"] == scale.nodes
                 and c["devices_per_node"] == scale.devices_per_node]
        if not found:
            raise ValueError(f"the results have no measured case {scale.name}"
                             + (f" at batch {batch}" if batch is not None else ""))
        cases = found
    else:
        cases = [c for c in cases if c["nodes"] == 1]
    if not cases:
        raise ValueError("the results have no measured single-node case to start from "
                         "(a 1-device or one-node case with a median throughput)")
    batches = {c["batch_size_per_device"] for c in cases}
    if len(batches) > 1:
        raise ValueError(f"the results hold batch sizes {sorted(batches)}: choose one with "
                         f"--batch-size")
    ones = [c for c in cases if c["world_size"] == 1]
    return ones[0] if ones else max(cases, key=lambda c: c["world_size"])


def job_from(doc: dict, batch: int, *, backbone_params: int | None = None,
             backbone_gflops: float | None = None, bucket_mb: float | None = None,
             grad_bytes: int = 4, overlap: bool = True) -> Job:
    """The job to project: the results' workload at ``batch``; a backbone trainperf has no
    model of is given by its parameters and forward GFLOPs per sample."""
    w = doc.get("workload") or {}
    if backbone_params is not None or backbone_gflops is not None:
        if backbone_params is None or backbone_gflops is None:
            raise ValueError("--backbone-params and --backbone-gflops go together")
        params, flops = backbone_params, backbone_gflops * 1e9
    else:
        if not w.get("backbone"):
            raise ValueError("the results name no backbone: pass --backbone-params and "
                             "--backbone-gflops")
        params, flops = backbone_counts(
            w["backbone"], int(w.get("input_size", 112)), int(w.get("embedding_size", 512)),
            int(w.get("num_classes", 1000)), w.get("output_block", "E"))
    face = w.get("task", "face") == "face"
    bucket_mb = (bucket_mb if bucket_mb is not None
                 else (doc.get("tuning") or {}).get("ddp_bucket_mb") or 25.0)
    if not bucket_mb > 0:
        raise ValueError(f"--bucket-mb must be > 0, got {bucket_mb}")
    return Job(fc=w.get("fc", "dp") if face else "dp", batch_size=batch,
               backbone_params=int(params), backbone_fwd_flops=float(flops),
               num_classes=int(w.get("num_classes", 0)) if face else 0,
               embedding_size=int(w.get("embedding_size", 0)) if face else 0,
               sample_ratio=float(w.get("sample_ratio", 1.0)), grad_bytes=grad_bytes,
               bucket_bytes=int(bucket_mb * MIB), overlap=overlap)


def fabric_from(intra_bw: float | None, inter_bw: float | None, intra_latency_us: float,
                inter_latency_us: float, commbench: list[str] | None = None) -> Fabric:
    """The fabric: commbench results where given (one measured on a single node gives the
    intra-node figures, one on several nodes the inter-node ones), the bandwidths (GB/s) and
    latencies (us) given filling what they lack."""
    for name, value in (("intra-bw", intra_bw), ("inter-bw", inter_bw)):
        if value is not None and not value > 0:
            raise ValueError(f"--{name} must be > 0 GB/s, got {value}")
    flags = uniform_fabric(
        intra_bw * 1e9 if intra_bw is not None else None,
        inter_bw * 1e9 if inter_bw is not None else None,
        intra_latency_us * 1e-6, inter_latency_us * 1e-6)
    if not commbench:
        return Fabric(flags.intra, flags.inter, "flags")
    from .commbench import load_fabric  # launches nothing; only its reader is needed

    measured = [load_fabric(path) for path in commbench]
    return fabric_from_commbench(measured, fill=flags,
                                 source="commbench: " + ", ".join(commbench))


def step_ratios(case: dict) -> tuple[float, ...]:
    """Each measured step's time over its run's median, every ok run of the case."""
    ratios: list[float] = []
    for run in case.get("runs") or []:
        times = [t for t in run.get("step_times_s") or [] if t and t > 0]
        if run.get("status") == "ok" and times:
            middle = statistics.median(times)
            ratios += [t / middle for t in times]
    return tuple(ratios)


def document(path: Path, doc: dict, base: dict, job: Job, fabric: Fabric,
             predictions: list[Prediction], ratios: tuple[float, ...] = ()) -> dict[str, Any]:
    return {"schema": SCHEMA, "results": str(path), "recipe": doc.get("recipe"),
            "base": {"case": base["case"], "batch_size_per_device": base["batch_size_per_device"],
                     "median_samples_per_s": base["median_samples_per_s"],
                     "step_times": len(ratios)},
            "job": job.to_dict(), "fabric": fabric.to_dict(),
            "model": "trainperf.scale.model (its docstring states every assumption)",
            "predictions": [p.to_dict() for p in predictions]}


def out_path(out: str | None, results: Path, root: Path | None = None) -> Path:
    """Where the projection goes: ``out`` (a ``.json`` file or a folder), else beside the
    results. ``root``: the folder given for several plans, whose layout a folder ``out``
    repeats (``OUT/torch/project.json``)."""
    if not out:
        return results.parent / "project.json"
    p = Path(out)
    if p.suffix == ".json":
        return p
    where = results.parent.relative_to(root) if root is not None and root.is_dir() else Path()
    return p / where / "project.json"


def project_results(path: Path, to: str, fabric: dict[str, Any], job: dict[str, Any],
                    base: str | None = None, batch: int | None = None,
                    stragglers: bool = True) -> tuple[dict, list[Prediction], Path]:
    """Project the measured base case of the results.json at ``path`` to the
    scales of ``to`` (``2n8g,4n8g``), with ``fabric_from(**fabric)`` and ``job_from``'s
    keywords ``job``: the projection document, its predictions, and the results file.
    ``stragglers``: draw each rank's step from the base's measured step times."""
    from .. import results

    scales = parse_scales(to)
    doc = results.load(path)
    base_case = pick_base(doc, base, batch)
    base_scale = Scale(base_case["nodes"], base_case["devices_per_node"])
    links = fabric_from(**fabric)
    for s in (base_scale, *scales):  # name a missing bandwidth before counting the backbone
        if s.world_size > 1:
            links.link("all_reduce", s.nodes > 1)
    job_ = job_from(doc, base_case["batch_size_per_device"], **job)
    ratios = step_ratios(base_case) if stragglers else ()
    predictions = project(job_, base_scale, base_case["median_samples_per_s"], scales, links,
                          ratios)
    return (document(path, doc, base_case, job_, links, predictions, ratios), predictions,
            path)
