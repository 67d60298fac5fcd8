"""The published rows that match a result's cases, side by side, per device and as MFU."""

from __future__ import annotations

from .. import references
from ..devices import mfu_peak
from ..recipes import RECIPES
from .markdown import fmt, pct, table


def reference_model(doc: dict) -> tuple[str | None, str]:
    recipe = RECIPES.get(doc.get("recipe", ""))
    if recipe is not None:
        return recipe.reference_model, recipe.reference_mode
    return doc.get("workload", {}).get("backbone"), ""  # ingested: the model named in the logs


def published_mfu(ref: references.Reference, flops: float | None,
                  flops_by_op: dict | None) -> float | None:
    """A published row's MFU for work of ``flops`` per sample (split by engine as
    ``flops_by_op``), at the peak of the device DLPerf ran on."""
    # V100 has no TF32: its fp32 rows ran every FLOP at the fp32 peak.
    peak, _ = mfu_peak(references.DEVICE, "fp16" if ref.precision == "amp" else ref.precision,
                       flops_by_op)
    return ref.samples_per_s * flops / (peak * ref.world_size) if flops and peak else None


def references_section(doc: dict, label: str) -> str | None:
    model, mode = reference_model(doc)
    w = doc.get("workload", {})
    rows = []
    for c in doc["cases"]:
        refs = references.matching(model, mode, w.get("fc"), w.get("sample_ratio"),
                                   c["precision"], c["batch_size_per_device"], c["world_size"])
        ours = c["median_samples_per_s"]
        flops = c.get("train_flops_per_sample")
        by_op = c.get("train_flops_by_op") or ({"conv": flops} if flops else None)
        for ref in refs:
            ref_mfu = published_mfu(ref, flops, by_op)
            rows.append([
                str(c["nodes"]), str(c["world_size"]), str(c["batch_size_per_device"]),
                fmt(ours), fmt(ours / c["world_size"]) if ours else "-", pct(c.get("mfu")),
                ref.framework, " ".join(v for v in (ref.mode_items.get("dataset"),
                                                    ref.mode_items.get("parallel"),
                                                    ref.mode_items.get("sample_ratio")) if v),
                fmt(ref.samples_per_s), fmt(ref.samples_per_s / ref.world_size),
                pct(ref_mfu), fmt(ref.speedup), ref.source.split(" ; ")[0],
            ])
    if not rows:
        return None
    header = ["node_num", "gpu_num", "batch/device", "ours samples/s", "ours per device",
              "ours MFU", "published", "mode", "samples/s", "per device", "MFU (V100 peak)", "speedup",
              "source"]
    return (f"### Published DLPerf figures beside {label}\n\n"
            f"Published rows ran on {references.DEVICE}; MFU puts both on the same footing "
            "(same model FLOPs, each device's own peak).\n\n" + table(header, rows))
