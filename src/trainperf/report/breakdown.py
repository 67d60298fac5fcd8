"""Where each case's step time goes (``run --breakdown``): a table of phases per framework and
device count, the FLOP/s each phase achieved against the measured matmul rate, the exposed
communication against what a ``commbench`` fabric predicts, a verdict in words per case
(``scale.bottleneck`` works those out), and a stacked bar chart per case shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..backends.phases import PHASES, label
from .markdown import table
from .plots import _pyplot

Analyse = Callable[[dict, dict], "dict[str, Any] | None"]


def _times_only(doc: dict, case: dict) -> dict[str, Any]:
    bd = case["breakdown"]
    if bd.get("status") != "ok" or not bd.get("phases_s"):
        return {"error": bd.get("error") or f"the profiled run {bd.get('status')}"}
    step = (case["world_size"] * case["batch_size_per_device"] / case["median_samples_per_s"]
            if case.get("median_samples_per_s") else None)
    return {"rates": {}, "matmul": bd.get("matmul_flops_per_s"), "timed_step_s": step,
            "predicted_comm_s": None, "verdict": "no verdict (the report was made without "
                                                 "the scaling model)"}

def share_text(x: float) -> str:
    return f"{100 * x:.0f}%"


def rate_text(x: float) -> str:
    return f"{x / 1e12:.3g} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.3g} GFLOP/s"


def ms_text(x: float) -> str:
    return f"{1000 * x:.1f} ms" if x < 1 else f"{x:.2f} s"


def breakdown_section(docs: list[dict], labels: list[str], out_dir: Path,
                      analyse: Analyse | None = None) -> str | None:
    """The report's breakdown section, its plots written into ``out_dir`` and shown in it
    (None where no case has a breakdown). ``analyse(doc, case)`` gives a case's rates and
    verdict (``scale.bottleneck``); without it the phases' times alone."""
    rows = [(doc, lab, case) for doc, lab in zip(docs, labels) for case in doc["cases"]
            if case.get("breakdown")]
    if not rows:
        return None
    found = [(analyse or _times_only)(doc, case) for doc, _, case in rows]
    names = sorted({n for _, _, c in rows for n in (c["breakdown"].get("phases_s") or {})},
                   key=lambda n: PHASES.index(n.split("+")[0]))
    header = ["results", "case", "batch", *[label(n) for n in names], "profiled step",
              "timed step"]
    body, lines, rate_rows, comm_rows = [], [], [], []
    for (doc, lab, case), f in zip(rows, found):
        where = [lab, case["case"], str(case["batch_size_per_device"])]
        if "error" in f:
            body.append([*where, *["-"] * len(names), "-", "-"])
            lines.append(f"- **{lab} {case['case']}**: no breakdown ({f['error']})")
            continue
        bd = case["breakdown"]
        cells = [f"{ms_text(bd['phases_s'][n])} ({share_text(bd['shares'][n])})"
                 if n in bd["phases_s"] else "-" for n in names]
        body.append([*where, *cells, ms_text(bd["step_s"]),
                     ms_text(f["timed_step_s"]) if f["timed_step_s"] else "-"])
        lines.append(f"- **{lab} {case['case']} b{case['batch_size_per_device']}**: "
                     f"{f['verdict']}.")
        if f["rates"]:
            rate_rows.append((where, f["rates"], f["matmul"], bd.get("matmul_what")))
        if case["world_size"] > 1 and "grad_comm" in bd["phases_s"]:
            comm_rows.append([*where, ms_text(bd["phases_s"]["grad_comm"]),
                              ms_text(f["predicted_comm_s"]) if f["predicted_comm_s"] is not None
                              else "no fabric given (`--fabric commbench.json`)",
                              ", ".join(f"{p}: {', '.join(c)}" for p, c in
                                        (bd.get("collectives") or {}).items()) or "-"])
    parts = ["## Where the time goes (`--breakdown`)", "",
             "One profiled run per case, after its timed runs and outside every statistic: its "
             "phases are fenced, so its step is not a result. Each phase is its median over "
             "the profiled steps, with its share of the median profiled step.", "",
             table(header, body), "", *lines, ""]
    if rate_rows:
        rated = [n for n in names if any(n in r for _, r, _, _ in rate_rows)]
        cells = [[*where, *[(rate_text(r[n]) + (f" ({share_text(r[n] / matmul)})" if matmul else ""))
                            if n in r else "-" for n in rated],
                  f"{rate_text(matmul)} ({what})" if matmul else "-"]
                 for where, r, matmul, what in rate_rows]
        parts += ["Achieved rate per phase (FLOPs one device runs in it over its time) against "
                  "the framework's own square GEMM measured on the same device:", "",
                  table(["results", "case", "batch", *[label(n) for n in rated], "matmul"],
                        cells), ""]
    if comm_rows:
        parts += ["Gradient communication not hidden by compute, against the fabric's "
                  "prediction for the gradient bytes (`scale.model`), and the collectives the "
                  "profiler saw in each phase:", "",
                  table(["results", "case", "batch", "measured", "predicted", "collectives"],
                        comm_rows), ""]
    methods = sorted({(lab, case["breakdown"]["method"]) for _, lab, case in rows
                      if case["breakdown"].get("method")})
    parts += ["How each framework's phases were told apart:", "",
              *[f"- {lab}: {m}" for lab, m in methods]]
    merged = sorted({(lab, n, why) for _, lab, case in rows
                     for n, why in (case["breakdown"].get("merged") or {}).items()})
    parts += [f"- {lab} merges {label(n)}: {why}" for lab, n, why in merged]
    traces = [(lab, case) for _, lab, case in rows if case["breakdown"].get("trace")]
    if traces:
        parts += ["", "Traces (`--trace`):", ""]
        parts += [f"- {lab} {case['case']}: `{case['breakdown']['trace']}`; "
                  f"{case['breakdown'].get('trace_open') or ''}" for lab, case in traces]
    plots = plot_breakdowns(rows, out_dir)
    parts += [""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(parts).rstrip() + "\n"


def plot_breakdowns(rows: list[tuple[dict, str, dict]], out_dir: Path) -> list[str]:
    """One stacked bar chart per case shape (batch, head, precision): a bar per results folder
    and device count, its phases stacked in ms. [] without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return []
    groups: dict[tuple, list[tuple[str, dict]]] = {}
    for doc, lab, case in rows:
        bd = case["breakdown"]
        if bd.get("status") != "ok" or not bd.get("phases_s"):
            continue
        key = (case["batch_size_per_device"], case.get("fc") or "", case.get("num_classes") or 0,
               case["precision"])
        groups.setdefault(key, []).append((f"{lab} x{case['world_size']}", bd))
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    colors = plt.get_cmap("tab10")
    for (batch, fc, classes, precision), bars in groups.items():
        phases = sorted({n for _, bd in bars for n in bd["phases_s"]},
                        key=lambda n: PHASES.index(n.split("+")[0]))
        fig, ax = plt.subplots(figsize=(8, 0.6 * len(bars) + 2.6))
        left = [0.0] * len(bars)
        for i, name in enumerate(phases):
            widths = [1000 * max(bd["phases_s"].get(name, 0.0), 0.0) for _, bd in bars]
            ax.barh([b for b, _ in bars], widths, left=left, label=label(name),
                    color=colors(i % 10))
            left = [a + w for a, w in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median of the profiled steps)")
        title = f"Where the step goes: batch {batch}/device"
        if fc:
            title += f", {fc}, {classes:,} classes"
        ax.set_title(f"{title}, {precision}")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4,
                  frameon=False)
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        file = f"breakdown-b{batch}{'-' + fc if fc else ''}-{precision}.png"
        fig.savefig(out_dir / file, dpi=110)
        plt.close(fig)
        names.append(file)
    return names
