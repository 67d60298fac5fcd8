"""The memory model's GPU constants, fitted to the peaks a GPU record holds.

Every torch run on CUDA in a record (its ``results.json`` files and those inside its parts'
archives) gives a point: the model's components, the measured peak and the device's memory.
fp16 and bf16 points fit the backward factor (``capacity.fit``). fp32 points of backbones with
dense convolutions then fit the elastic workspace over that factor, least squares on the
activation bytes; a point whose prediction with the workspace exceeds the device's memory is
left out (its autotuning could not take the workspace), and so are depthwise backbones
(MobileFaceNet), whose peaks hold no such workspace: both are shown, not fitted.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from ..backends.torch.memory_model import DeviceConstants, combine, constants_for
from .capacity import fit
from ..result_files import json_files

DEPTHWISE = ("mobilefacenet",)
OLD = DeviceConstants(1.5, 0, "the CPU's backward factor (before the H200 fit)")


def _memory_bytes(env: dict) -> int | None:
    for gpu in env.get("gpus") or []:
        m = re.match(r"(\d+)\s*MiB", str(gpu.get("memory_total", "")))
        if m:
            return int(m.group(1)) * 2**20
    return None


def points_of(doc: dict, where: str) -> list[dict]:
    env = doc.get("env") or {}
    if doc.get("framework", "torch") != "torch" or env.get("device_type") != "cuda":
        return []
    backbone = (doc.get("workload") or {}).get("backbone", "")
    out = []
    for c in doc.get("cases", []):
        ok = [r for r in c["runs"] if r["status"] == "ok" and r.get("peak_memory_bytes")]
        if c.get("memory_model") and ok:
            out.append({"where": where, "backbone": backbone, "precision": c["precision"],
                        "batch": c["batch_size_per_device"], "parts": c["memory_model"],
                        "peak": ok[0]["peak_memory_bytes"], "baseline": 0,
                        "limit": _memory_bytes(env)})
    return out


def record_points(record: Path) -> list[dict]:
    """Every point of a record folder, each once (a tiny recipe's points are left out: the
    CUDA context's share of them is beyond any model of the step)."""
    found = []
    for name, text in json_files(record, ("results.json",)):
        folder = name.rsplit("/", 1)[0]
        if ".tar.gz/" in name:
            if "/runs/" not in folder:
                continue
            folder = folder.split("/runs/", 1)[1]  # a check's run, named by its case
        found += points_of(json.loads(text), folder)
    return [p for p in found if not p["backbone"].endswith("_tiny")]


def _lstsq(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def fit_workspace(points: list[dict], factor: float) -> tuple[int, float, list[dict]]:
    """(bytes, share of the activations) of the fp32 workspace, and the points it was fitted
    to."""
    base = DeviceConstants(factor, 0, "")
    used = list(points)
    while True:
        xs = [p["parts"]["activation_bytes"] for p in used]
        ys = [p["peak"] - combine(p["parts"], base) for p in used]
        fixed, share = _lstsq(xs, ys)
        fixed, share = round(fixed / 2**20) * 2**20, round(share, 3)
        trial = replace(base, workspace_bytes=fixed, workspace_per_activation=share)
        keep = [p for p in used if not p["limit"] or combine(p["parts"], trial) <= p["limit"]]
        if len(keep) == len(used):
            return fixed, share, used
        used = keep


def fit_record(record: Path) -> dict:
    points = record_points(record)
    half = [p for p in points if p["precision"] in ("fp16", "bf16")]
    fp32 = [p for p in points if p["precision"] == "fp32"]
    dense = [p for p in fp32 if not p["backbone"].startswith(DEPTHWISE)]
    factor = fit(half).backward_factor
    fixed, share, used = fit_workspace(dense, factor)
    return {"record": str(record), "points": points, "backward_factor": factor,
            "workspace_bytes": fixed, "workspace_per_activation": share,
            "half_points": len(half), "fp32_points_fitted": len(used),
            "fp32_fitted": [p["where"] for p in used]}


def errors(points: list[dict], constants_by_precision) -> list[dict]:
    """Each point's (predicted - peak) / peak under the given constants, the workspace stopped
    at the device's memory."""
    out = []
    for p in points:
        c = constants_by_precision(p["precision"])
        predicted = combine(p["parts"], c, p["limit"])
        out.append({**{k: p[k] for k in ("where", "backbone", "precision", "batch", "peak")},
                    "predicted": predicted, "error": (predicted - p["peak"]) / p["peak"]})
    return out


def committed(precision: str) -> DeviceConstants:
    return constants_for("cuda", precision)
