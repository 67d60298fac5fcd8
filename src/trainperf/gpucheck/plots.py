"""The summary's plots (matplotlib, where installed): the ceiling against the datasheet, the
seeds' cases against DLPerf's V100 rows, and the capacity probes against the memory model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..devices import TFLOPS
from .plan import get_stage
from .record import items


def write_plots(doc: dict, out: Path) -> list[str]:
    """The plots written into ``out``, by file name (none without matplotlib)."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages: dict[str, list[dict]] = {}
    for s in doc["stages"]:
        stages.setdefault(get_stage(s["stage"]).kind, []).append(s)
    written = []
    for name, draw in (("ceiling.png", _ceiling), ("seeds.png", _seeds),
                       ("capacity.png", _capacity)):
        fig = draw(plt, doc, stages)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def _ceiling(plt, doc: dict, stages: dict):
    rows = [c for s in stages.get("ceiling", []) for c in items(s, "ceiling")
            if c.get("flops_per_s")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [c["flops_per_s"] / TFLOPS for c in rows], 0.4,
           label="measured")
    ax.bar([i + 0.2 for i in x], [(c.get("datasheet") or 0) / TFLOPS for c in rows], 0.4,
           label="datasheet (dense)")
    ax.set_xticks(list(x), [c["format"] for c in rows])
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Matrix-product ceiling: {doc['device']}", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def _seeds(plt, doc: dict, stages: dict):
    cases = [c for s in stages.get("cases", []) for c in items(s, "case")
             if c.get("median_samples_per_s")]
    if not cases:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(cases) + 1.5))
    y = range(len(cases))
    ax.barh([i + 0.2 for i in y], [c["median_samples_per_s"] for c in cases], 0.4,
            label=f"trainperf, {doc['device']}")
    ax.barh([i - 0.2 for i in y], [(c.get("dlperf") or {}).get("samples_per_s", 0)
                                   for c in cases], 0.4, label="fastest DLPerf row, V100")
    ax.set_yticks(list(y), [c["label"] for c in cases], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("samples/s on one device")
    ax.legend(fontsize=8)
    return fig


def _capacity(plt, doc: dict, stages: dict):
    searches = [x for s in stages.get("capacity", []) for x in items(s, "search")]
    if not searches:
        return None
    fig, axes = plt.subplots(1, len(searches), figsize=(5 * len(searches), 3.5), squeeze=False)
    for ax, s in zip(axes[0], searches):
        probes = sorted(s["probes"], key=lambda p: p["value"])
        fit = [p for p in probes if p.get("peak_bytes")]
        ax.plot([p["value"] for p in fit], [p["peak_bytes"] / 2**30 for p in fit], "o-",
                label="measured peak")
        pred = [p for p in probes if p.get("predicted_bytes")]
        ax.plot([p["value"] for p in pred], [p["predicted_bytes"] / 2**30 for p in pred], "x--",
                label="memory model")
        failed = [p["value"] for p in probes if p["status"] != "ok"]
        if failed:
            ax.scatter(failed, [0] * len(failed), marker="v", color="red", label="failed")
        if s.get("limit_bytes"):
            ax.axhline(s["limit_bytes"] / 2**30, color="grey", lw=0.8, label="limit")
        ax.set_title(f"{s['search']}: {s['label']}", fontsize=9)
        ax.set_xlabel("batch per device" if s["search"] == "max-batch" else "classes")
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7)
    return fig
