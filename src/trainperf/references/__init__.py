"""Published DLPerf figures (V100-SXM2-16GB nodes of 8 GPUs) as data to compare against.

The CSV files beside this module were rebuilt from DLPerf's reports; README.md here says how.
They are not truth: the frameworks' own methods differ (some average per-step rates, windows
vary), which is why trainperf records its own method beside every figure.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources

DEVICE = "Tesla V100-SXM2-16GB"
FILES = ("insightface.csv", "resnet50.csv")


@dataclass(frozen=True)
class Published:
    """What every published row says about where it ran."""

    framework: str
    model: str
    precision: str
    batch_size_per_device: int
    nodes: int
    devices_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class Reference(Published):
    samples_per_s: float
    speedup: float | None
    mode: str
    source: str
    suite: str

    @property
    def mode_items(self) -> dict[str, str]:
        out = {}
        for part in self.mode.split(";"):
            key, _, value = part.partition("=")
            if key:
                out[key.strip()] = value.strip()
        return out


@dataclass(frozen=True)
class ClassCapacity(Published):
    model_parallel: bool
    partial_fc: bool
    sample_ratio: float | None
    max_num_classes: int
    data: str
    source: str


def _rows(name: str) -> list[dict[str, str]]:
    text = resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    return list(csv.DictReader(text.splitlines()))


def _where(r: dict[str, str]) -> tuple:
    return (r["framework"], r["model"], r["precision"], int(r["batch_size_per_device"]),
            int(r["nodes"]), int(r["gpus_per_node"]))


def load_throughput() -> list[Reference]:
    out = []
    for name in FILES:
        for r in _rows(name):
            out.append(Reference(
                *_where(r), float(r["samples_per_s"]),
                float(r["speedup"]) if r["speedup"] else None, r["mode"], r["source_file"],
                r["suite"]))
    return out


def load_max_classes() -> list[ClassCapacity]:
    return [ClassCapacity(
        *_where(r), r["model_parallel"] == "True",
        r["partial_fc"] == "True", float(r["sample_ratio"]) if r["sample_ratio"] else None,
        int(r["max_num_classes"]), r["data"], r["source_file"])
        for r in _rows("insightface_max_num_classes.csv")]


FC_PARALLEL = {"dp": ("data_parallel",), "mp": ("model_parallel", "plsc_model_parallel"),
               "pfc": ("partial_fc",)}
PRECISION_ALIASES = {"fp32": ("fp32",), "fp16": ("fp16", "amp"), "bf16": ("amp",)}


def matching(model: str | None, required_mode: str, fc: str | None, sample_ratio: float | None,
             precision: str, batch: int, world_size: int,
             refs: list[Reference] | None = None) -> list[Reference]:
    """Published rows comparable with one of our cases: same model, mode, precision, batch per
    device and device count."""
    if not model:
        return []
    required = dict(p.split("=", 1) for p in required_mode.split(";") if "=" in p)
    out = []
    for ref in refs if refs is not None else load_throughput():
        items = ref.mode_items
        if ref.model != model:
            continue
        if required.get("framework") and ref.framework.split("_")[0] != required["framework"]:
            continue
        if any(items.get(k) != v for k, v in required.items() if k != "framework"):
            continue
        if fc and "parallel" in items and items["parallel"] not in FC_PARALLEL[fc]:
            continue
        if fc == "pfc" and sample_ratio is not None and items.get("sample_ratio") and (
                float(items["sample_ratio"]) != sample_ratio):
            continue
        if ref.precision not in PRECISION_ALIASES.get(precision, (precision,)):
            continue
        if ref.batch_size_per_device != batch or ref.world_size != world_size:
            continue
        out.append(ref)
    return out
