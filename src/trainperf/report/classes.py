"""A class sweep in the report: speed and memory against the number of identities, one row per
case, as insightface's arcface_torch speed table has them (identities, head mode, samples/s,
memory per GPU), and both plotted against identities on a log axis."""

from __future__ import annotations

from pathlib import Path

from .markdown import fmt, framework_name, head_key, is_class_sweep, memory_kind_text, table
from .plots import _pyplot


def _framework(doc: dict) -> str:
    # The backend's name first: a case whose runs all failed never reported the framework's
    # own name (``pytorch``), and one framework must not become two lines.
    return doc.get("framework") or framework_name(doc)


def _head(fc: str | None, ratio: float | None) -> str:
    return f"pfc {ratio:g}" if fc == "pfc" and ratio is not None else (fc or "-")


def _rows(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(document, case) of every case, by identities, framework (in the order given), head,
    devices and batch."""
    frameworks = list(dict.fromkeys(_framework(d) for d in docs))

    def order(pair: tuple[dict, dict]) -> tuple:
        doc, case = pair
        classes, fc, ratio = head_key(doc)
        return (classes or 0, frameworks.index(_framework(doc)), fc or "",
                -(ratio or 1.0), case["world_size"], case["batch_size_per_device"])

    return sorted(((d, c) for d in docs for c in d["cases"]), key=order)


def _speed(case: dict) -> str:
    """The median, or what became of the runs when none gave a figure (an OOM is a result)."""
    runs = case["runs"]
    if case["median_samples_per_s"] is None:
        bad = sorted({r["status"] for r in runs if r["status"] != "ok"})
        return f"**{', '.join(bad)}**" if bad else "no figure"
    ok = case.get("ok_runs", len(runs))
    return fmt(case["median_samples_per_s"]) + ("" if ok == len(runs) else
                                                f" ({ok}/{len(runs)} runs)")


def classes_section(docs: list[dict]) -> str | None:
    """The identities table of a class sweep (None when ``docs`` are not one)."""
    if not is_class_sweep(docs):
        return None
    several_batches = len({c["batch_size_per_device"] for d in docs for c in d["cases"]}) > 1
    rows = []
    for doc, case in _rows(docs):
        classes, fc, ratio = head_key(doc)
        peak = case.get("peak_memory_bytes")
        rows.append([f"{classes:,}" if classes else "-", _framework(doc), _head(fc, ratio),
                     str(case["world_size"]),
                     *([str(case["batch_size_per_device"])] if several_batches else []),
                     _speed(case), fmt(case["speedup"]),
                     f"{peak / 2**30:.2f}" if peak else "-", memory_kind_text(case)])
    header = ["identities", "framework", "head", "devices",
              *(["batch/device"] if several_batches else []), "samples/s", "speedup",
              "peak memory / device (GiB)", "memory kind"]
    return "\n".join([
        "## Against the number of identities", "",
        "Each row is one case; its speedup is against 1 device at the same identities and head. "
        "Peak memory is the largest of the ranks' figures, of the kind named beside it (the "
        "framework allocator's peak, device-wide used memory where the framework keeps no "
        "peak, the resident set on a CPU): figures of different kinds do not compare. A case "
        "whose runs all failed shows how they ended.", "",
        table(header, rows)])


def _lines(docs: list[dict]) -> dict[str, list[dict]]:
    """The cases of each plotted line (framework, head, and devices and batch where they vary),
    by identities."""
    worlds = len({c["world_size"] for d in docs for c in d["cases"]}) > 1
    batches = len({c["batch_size_per_device"] for d in docs for c in d["cases"]}) > 1
    frameworks = len({_framework(d) for d in docs}) > 1
    kinds = len({c.get("memory_kind") for d in docs for c in d["cases"]}) > 1
    lines: dict[str, list[dict]] = {}
    for doc, case in _rows(docs):
        classes, fc, ratio = head_key(doc)
        # Memory of different kinds on one axis: each line says which it is.
        name = " ".join([*([_framework(doc)] if frameworks else []), _head(fc, ratio),
                         *([f"{case['world_size']} dev"] if worlds else []),
                         *([f"b{case['batch_size_per_device']}"] if batches else []),
                         *([f"({memory_kind_text(case)})"] if kinds else [])])
        lines.setdefault(name, []).append({**case, "identities": classes})
    return lines


def _short(n: int) -> str:
    for size, unit in ((10**6, "M"), (10**3, "k")):
        if n >= size:
            return f"{n / size:g}{unit}"
    return str(n)


def _figure(case: dict, key: str) -> float | None:
    if key == "samples_per_s":
        return case["median_samples_per_s"]
    peak = case.get("peak_memory_bytes")
    return peak / 2**30 if peak else None


def plot_classes(docs: list[dict], out_dir: Path) -> list[str]:
    """classes_throughput.png and classes_memory.png of a sweep over more than one class count
    ([] otherwise, or without matplotlib). A failed case is an x on the axis of its line."""
    if not is_class_sweep(docs) or len({head_key(d)[0] for d in docs}) < 2:
        return []
    plt = _pyplot()
    if plt is None:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {"samples_per_s": plt.subplots(figsize=(7, 4.5)),
               "peak_memory_bytes": plt.subplots(figsize=(7, 4.5))}
    ticks = sorted({head_key(d)[0] for d in docs})
    for name, cases in _lines(docs).items():
        for key, (_, ax) in figures.items():
            points = [(c["identities"], _figure(c, key)) for c in cases
                      if _figure(c, key) is not None]
            line, = ax.plot(*zip(*points), "o-", label=name) if points else ax.plot([], [])
            failed = [c["identities"] for c in cases if c["median_samples_per_s"] is None]
            if failed:
                # On the axis: a failed case has no figure to place, but its absence is a result.
                ax.plot(failed, [0.0] * len(failed), "x", color=line.get_color(),
                        markersize=9, transform=ax.get_xaxis_transform(), clip_on=False,
                        label=f"{name} failed")
    names = []
    for key, (fig, ax) in figures.items():
        ax.set_xscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([_short(n) for n in ticks])
        ax.minorticks_off()
        ax.set_xlabel("identities (classes)")
        ax.set_ylabel("samples/s (median of runs)" if key == "samples_per_s"
                      else "peak memory per device (GiB)")
        ax.set_title("Throughput against identities" if key == "samples_per_s"
                     else "Peak memory against identities")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.05)  # from zero: the drop is read as a share
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        name = "classes_throughput.png" if key == "samples_per_s" else "classes_memory.png"
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names
