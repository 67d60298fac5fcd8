"""Time to accuracy in the report: the outcome of every training variant side by side, and its
accuracy curve against training time and against steps."""

from __future__ import annotations

from pathlib import Path

from .markdown import fmt, pct, table
from .plots import _pyplot


def is_training(doc: dict) -> bool:
    return bool(doc.get("train"))


def _label(doc: dict, case: dict, several_cases: bool) -> str:
    name = (doc.get("train") or {}).get("variant") or doc.get("workload", {}).get("precision")
    return f"{name} {case['case']}" if several_cases else str(name)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def training_section(docs: list[dict]) -> str | None:
    """The side-by-side table of every training document's cases (None when there is none)."""
    trained = [d for d in docs if is_training(d)]
    if not trained:
        return None
    several = len({c["case"] for d in trained for c in d["cases"]}) > 1
    rows = []
    for doc in trained:
        for case in doc["cases"]:
            t = case.get("training") or {}
            runs = case["runs"]
            rows.append([_label(doc, case, several), str(case["world_size"]),
                         f"{t.get('runs_reached_target', 0)}/{len(runs)}",
                         _duration(t.get("median_time_to_target_s")),
                         fmt(t.get("median_steps_to_target"), 0),
                         pct(t.get("best_accuracy")),
                         fmt(case.get("median_samples_per_s"))])
    first = trained[0]["train"]
    sets = ", ".join(Path(v).stem for v in first.get("val", []))
    head = (f"## Time to accuracy\n\nTarget: {pct(first.get('target'))} 10-fold verification "
            f"accuracy on `{Path(first['val'][0]).stem}` (sets: {sets}), evaluated every "
            f"{first.get('eval_every')} steps, at most {first.get('max_steps')} steps. Time "
            "to target is training time (the sum of step times; evaluations and checkpoints "
            "excluded), median of the runs that reached it.")
    return "\n".join([head, "", table(["variant", "devices", "reached", "time to target",
                                       "steps to target", "best accuracy", "samples/s"], rows)])


def plot_training(docs: list[dict], out_dir: Path) -> list[str]:
    """accuracy_vs_time.png and accuracy_vs_steps.png ([] without matplotlib or curves)."""
    trained = [d for d in docs if is_training(d)]
    plt = _pyplot() if trained else None
    if plt is None:
        return []
    several = len({c["case"] for d in trained for c in d["cases"]}) > 1
    figs = {axis: plt.subplots(figsize=(7, 4.5)) for axis in ("train_s", "step")}
    target = None
    for doc in trained:
        target = target or doc["train"].get("target")
        for case in doc["cases"]:
            for run in case["runs"]:
                curve = (run.get("train") or {}).get("curve") or []
                if not curve:
                    continue
                label = _label(doc, case, several) + (f" run {run['run']}"
                                                      if len(case["runs"]) > 1 else "")
                acc = [100 * e["accuracy"] for e in curve]
                for axis, (_, ax) in figs.items():
                    ax.plot([e[axis] for e in curve], acc, "o-", markersize=3, label=label)
    names = []
    for axis, (fig, ax) in figs.items():
        if target is not None:
            ax.axhline(100 * target, color="k", linestyle="--", alpha=0.5, label="target")
        ax.set_xlabel("training time (s)" if axis == "train_s" else "optimizer steps")
        ax.set_ylabel("verification accuracy (%)")
        ax.set_title("Accuracy against " + ("training time" if axis == "train_s" else "steps"))
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        name = "accuracy_vs_time.png" if axis == "train_s" else "accuracy_vs_steps.png"
        out_dir.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names
