"""``trainperf project``: throughput at larger scales from a measured results.json and the
scaling model (``trainperf.scale.model``), with the fabric from commbench results or flags."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .model import (
    DEFAULT_INTER_LATENCY_S, DEFAULT_INTRA_LATENCY_S, MIB, Fabric, Job, Prediction, Scale,
    backbone_counts, fabric_from_commbench, parse_scales, project, uniform_fabric)

SCHEMA = "trainperf.project/v1"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("project", help="predict throughput at larger scales from a measured "
                       "step and a communication model")
    p.add_argument("results", metavar="RESULTS", help="a results.json or the folder holding it")
    p.add_argument("--to", required=True, metavar="SCALES",
                   help="target scales, NODESnDEVICESg, e.g. 2n8g,4n8g,16n8g,64n8g")
    p.add_argument("--fabric", action="append", metavar="COMMBENCH",
                   help="commbench.json (or its folder): one measured on a single node gives "
                        "the intra-node figures, one on several nodes the inter-node ones; "
                        "repeat for both")
    p.add_argument("--intra-bw", type=float, metavar="GB/s",
                   help="intra-node bus bandwidth (nccl-tests busbw, 1 GB = 1e9 bytes)")
    p.add_argument("--inter-bw", type=float, metavar="GB/s",
                   help="inter-node bus bandwidth (nccl-tests busbw of a multi-node ring)")
    p.add_argument("--intra-latency-us", type=float, default=DEFAULT_INTRA_LATENCY_S * 1e6,
                   help="latency of one collective within a node (default %(default)g)")
    p.add_argument("--inter-latency-us", type=float, default=DEFAULT_INTER_LATENCY_S * 1e6,
                   help="latency of one collective across nodes (default %(default)g)")
    p.add_argument("--base", metavar="CASE", help="case to start from, e.g. 1n1g or 1n8g "
                   "(default: the 1-device case, else the largest single-node one)")
    p.add_argument("--batch-size", type=int, help="batch per device of the base case, when "
                   "the results hold several")
    p.add_argument("--bucket-mb", type=float, help="gradient bucket size in MiB (default: the "
                   "results' --ddp-bucket-mb, else 25)")
    p.add_argument("--grad-bytes", type=int, choices=(2, 4), default=4,
                   help="bytes per all-reduced gradient: 4 when parameters stay fp32 (trainperf's "
                        "autocast), 2 when the model is cast to half (default 4)")
    p.add_argument("--no-overlap", action="store_true",
                   help="the all-reduce runs after the backward instead of during it")
    p.add_argument("--backbone-params", type=int,
                   help="parameters of a backbone trainperf has no model of")
    p.add_argument("--backbone-gflops", type=float,
                   help="its forward GFLOPs per sample (multiply-add = 2 FLOPs)")
    p.add_argument("--out", help="project.json, or a folder for it (default: beside RESULTS)")
    return p


def results_path(text: str) -> Path:
    p = Path(text)
    return p / "results.json" if p.is_dir() else p


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


def job_from(doc: dict, batch: int, args: argparse.Namespace) -> Job:
    w = doc.get("workload") or {}
    if args.backbone_params is not None or args.backbone_gflops is not None:
        if args.backbone_params is None or args.backbone_gflops is None:
            raise ValueError("--backbone-params and --backbone-gflops go together")
        params, flops = args.backbone_params, args.backbone_gflops * 1e9
    else:
        if not w.get("backbone"):
            raise ValueError("the results name no backbone: pass --backbone-params and "
                             "--backbone-gflops")
        params, flops = backbone_counts(
            w["backbone"], int(w.get("input_size", 112)), int(w.get("embedding_size", 512)),
            int(w.get("num_classes", 1000)), w.get("output_block", "E"))
    face = w.get("task", "face") == "face"
    bucket_mb = (args.bucket_mb if args.bucket_mb is not None
                 else (doc.get("tuning") or {}).get("ddp_bucket_mb") or 25.0)
    if not bucket_mb > 0:
        raise ValueError(f"--bucket-mb must be > 0, got {bucket_mb}")
    return Job(fc=w.get("fc", "dp") if face else "dp", batch_size=batch,
               backbone_params=int(params), backbone_fwd_flops=float(flops),
               num_classes=int(w.get("num_classes", 0)) if face else 0,
               embedding_size=int(w.get("embedding_size", 0)) if face else 0,
               sample_ratio=float(w.get("sample_ratio", 1.0)), grad_bytes=args.grad_bytes,
               bucket_bytes=int(bucket_mb * MIB), overlap=not args.no_overlap)


def fabric_from(args: argparse.Namespace) -> Fabric:
    for name in ("intra_bw", "inter_bw"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 GB/s, got {value}")
    flags = uniform_fabric(
        args.intra_bw * 1e9 if args.intra_bw is not None else None,
        args.inter_bw * 1e9 if args.inter_bw is not None else None,
        args.intra_latency_us * 1e-6, args.inter_latency_us * 1e-6)
    if not args.fabric:
        return Fabric(flags.intra, flags.inter, "flags")
    from .commbench import load_fabric  # launches nothing; only its reader is needed

    measured = [load_fabric(path) for path in args.fabric]
    return fabric_from_commbench(measured, fill=flags,
                                 source="commbench: " + ", ".join(args.fabric))


def document(path: Path, doc: dict, base: dict, job: Job, fabric: Fabric,
             predictions: list[Prediction]) -> dict[str, Any]:
    return {"schema": SCHEMA, "results": str(path), "recipe": doc.get("recipe"),
            "base": {"case": base["case"], "batch_size_per_device": base["batch_size_per_device"],
                     "median_samples_per_s": base["median_samples_per_s"]},
            "job": job.to_dict(), "fabric": fabric.to_dict(),
            "model": "trainperf.scale.model (its docstring states every assumption)",
            "predictions": [p.to_dict() for p in predictions]}


def out_path(args: argparse.Namespace, results: Path) -> Path:
    if not args.out:
        return results.parent / "project.json"
    p = Path(args.out)
    return p if p.suffix == ".json" else p / "project.json"


def print_table(doc: dict, predictions: list[Prediction]) -> None:
    from rich.console import Console
    from rich.table import Table

    base = doc["base"]
    tbl = Table(title=f"projected from {base['case']} ({base['median_samples_per_s']:.1f} "
                      f"samples/s, batch {base['batch_size_per_device']} per device)")
    for col in ("scale", "devices", "samples/s", "speedup", "efficiency", "step ms",
                "compute ms", "exposed all-reduce ms", "head comm ms", "limited by",
                "largest overhead"):
        tbl.add_column(col, no_wrap=col in ("scale", "devices"))
    for p in predictions:
        tbl.add_row(p.scale, str(p.world_size), f"{p.samples_per_s:.1f}", f"{p.speedup:.2f}",
                    f"{p.scaling_efficiency:.3f}", f"{p.step_s * 1e3:.1f}",
                    f"{(p.backbone_s + p.head_s) * 1e3:.1f}",
                    f"{p.allreduce_exposed_s * 1e3:.2f}", f"{p.head_comm_s * 1e3:.2f}",
                    p.limit, f"{p.overhead} ({p.overhead_share * 100:.1f}%)")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: keep every column whole
        console = Console(width=200)
    console.print(tbl)


def run(args: argparse.Namespace) -> int:
    from .. import results

    scales = parse_scales(args.to)
    path = results_path(args.results)
    doc = results.load(path)
    base = pick_base(doc, args.base, args.batch_size)
    base_scale = Scale(base["nodes"], base["devices_per_node"])
    fabric = fabric_from(args)
    for s in (base_scale, *scales):  # name a missing bandwidth before counting the backbone
        if s.world_size > 1:
            fabric.link("all_reduce", s.nodes > 1)
    job = job_from(doc, base["batch_size_per_device"], args)
    predictions = project(job, base_scale, base["median_samples_per_s"], scales, fabric)
    out = document(path, doc, base, job, fabric, predictions)
    print_table(out, predictions)
    target = out_path(args, path)
    results.write_json_atomic(target, out)
    print(f"projection: {target}")
    return 0
