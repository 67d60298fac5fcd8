"""PNG plots: throughput and speedup against devices, with the ideal-linear line.

matplotlib is an optional extra (``pip install trainperf[plot]``); without it no plot is made
and the report says so.
"""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scaling(docs: list[dict], labels: list[str], out_dir: Path) -> list[str]:
    """Write throughput.png and speedup.png; returns their file names ([] without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    fig_t, ax_t = plt.subplots(figsize=(7, 4.5))
    fig_s, ax_s = plt.subplots(figsize=(7, 4.5))
    max_world = 1
    for doc, label in zip(docs, labels):
        batches = sorted({c["batch_size_per_device"] for c in doc["cases"]})
        # A node sweep's document: a line per node count, so that 1n2g and 2n1g (two
        # devices each) are two points of two lines, not a zigzag of one.
        node_counts = sorted({c["nodes"] for c in doc["cases"]})
        for batch, nodes in [(b, n) for b in batches for n in node_counts]:
            cases = sorted((c for c in doc["cases"] if c["batch_size_per_device"] == batch
                            and c["nodes"] == nodes and c["median_samples_per_s"] is not None),
                           key=lambda c: c["world_size"])
            if not cases:
                continue
            name = label if len(batches) == 1 else f"{label} b{batch}"
            if len(node_counts) > 1:
                name += f" {nodes} node{'s' if nodes > 1 else ''}"
            worlds = [c["world_size"] for c in cases]
            max_world = max(max_world, *worlds)
            line, = ax_t.plot(worlds, [c["median_samples_per_s"] for c in cases], "o-",
                              label=name)
            base = next((c for c in doc["cases"] if c["world_size"] == 1
                         and c["batch_size_per_device"] == batch
                         and c["median_samples_per_s"] is not None), None)
            if base is not None and nodes == node_counts[0]:
                ax_t.plot([1, max(worlds)], [base["median_samples_per_s"],
                                             base["median_samples_per_s"] * max(worlds)], "--",
                          color=line.get_color(), alpha=0.5, label=f"{name} ideal")
            sp = [(c["world_size"], c["speedup"]) for c in cases if c["speedup"] is not None]
            if sp:
                ax_s.plot(*zip(*sp), "o-", label=name)
    ax_s.plot([1, max_world], [1, max_world], "k--", alpha=0.5, label="ideal (linear)")
    ticks = sorted({c["world_size"] for d in docs for c in d["cases"]})
    for ax, ylabel, title in ((ax_t, "samples/s (median of runs)", "Throughput"),
                              (ax_s, "speedup vs 1 device", "Speedup")):
        ax.set_xlabel("devices (world size)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_xticks(ticks)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    names = ["throughput.png", "speedup.png"]
    for fig, name in zip((fig_t, fig_s), names):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
    return names
