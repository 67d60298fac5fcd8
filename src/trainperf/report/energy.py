"""The report's energy section: samples per joule and watt-hours per million samples beside
samples/s, for the cases whose GPU boards' energy counter the runner read over each run's
window (``run_energy``); one line for the rest, saying why they have no figure."""

from __future__ import annotations

from .. import stats
from .markdown import fmt, pct, table

NOT_MEASURED = "not measured: "


def why_not(doc: dict, case: dict) -> str:
    """Why a case has no samples per joule, in a few words."""
    if "median_samples_per_j" not in case:
        return "recorded before trainperf read energy"
    if doc.get("train"):
        return "a training run's steps are timed apart from its evaluations, not as one window"
    note = case.get("energy_note")
    if not note:
        return "no run that counts has a figure"
    return note[len(NOT_MEASURED):] if note.startswith(NOT_MEASURED) else note


def _row(label: str, case: dict) -> list[str]:
    read = [r for r in case["runs"] if r.get("samples_per_j")]
    watts = stats.median([r["energy_j"] / r["window_s"] for r in read if r.get("window_s")])
    bounds = [r["energy_error_j"] / r["energy_j"] for r in read
              if r.get("energy_error_j") is not None and r.get("energy_j")]
    boards = len(read[0].get("energy_devices") or []) if read else 0
    return [label, case["case"], str(case["batch_size_per_device"]),
            fmt(case.get("median_samples_per_s")), fmt(case["median_samples_per_j"], 3),
            fmt(case.get("wh_per_million_samples"), 2), fmt(watts, 0),
            pct(max(bounds)) if bounds else "-", f"{len(read)}/{len(case['runs'])}",
            f"{boards} ({read[0].get('energy_scope')})" if read else "-"]


def energy_section(docs: list[dict], labels: list[str]) -> str:
    """The section: a table of the cases with a figure, and a line per reason for the others
    (one line in all where no case has one, as on a CPU)."""
    rows: list[list[str]] = []
    missing: dict[str, list[str]] = {}
    for doc, label in zip(docs, labels):
        for c in doc["cases"]:
            if c.get("median_samples_per_j"):
                rows.append(_row(label, c))
            else:
                where = f"{c['case']} b{c['batch_size_per_device']}"
                missing.setdefault(why_not(doc, c), []).append(
                    f"{label} {where}" if len(docs) > 1 else where)
    if not rows:
        return f"Energy: not measured ({'; '.join(missing) or 'no case'})."
    head = ["results", "case", "batch/device", "samples/s (median)", "samples/J (median)",
            "Wh per 1M samples", "mean W", "readings' bound", "runs read", "boards read"]
    lines = [
        "## Energy", "",
        "The GPU boards' own energy counter (NVML), read by the runner over each run's timed "
        "window and summed over every board the run drove, on every node: samples/J = the "
        "window's samples / those joules, the median over the runs that count; Wh per 1M "
        "samples = 10^6 / (samples/J) / 3600; mean W = joules / window seconds, all boards "
        "together. *Readings' bound*: the most the counter's readings around the window's "
        "edges allow the joules to be off (the largest of the runs). What the boards drew, "
        "not the hosts' CPUs, memory, network or cooling.", "",
        table(head, rows)]
    if missing:
        lines += ["", "Not measured:", ""]
        lines += [f"- {', '.join(where)}: {why}" for why, where in missing.items()]
    return "\n".join(lines)
