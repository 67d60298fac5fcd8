"""Time to accuracy in the report: the outcome of every training variant side by side, the runs
that did not finish and why, in words, and the accuracy curves against training time and
against steps."""

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
    rows, failed = [], []
    for doc in trained:
        for case in doc["cases"]:
            t = case.get("training") or {}
            runs = case["runs"]
            label = _label(doc, case, several)
            bad = [r for r in runs if r["status"] != "ok"]
            failed += [_failure(label, r, len(runs) > 1) for r in bad]
            rows.append([label, str(case["world_size"]),
                         f"{t.get('runs_reached_target', 0)}/{len(runs)}"
                         + (f" ({len(bad)} {'run' if len(bad) == 1 else 'runs'} failed)"
                            if bad else ""),
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
    parts = [head, "", table(["variant", "devices", "reached", "time to target",
                              "steps to target", "best accuracy", "samples/s"], rows)]
    if failed:
        parts += ["", "Runs that did not finish, and why:", "", *failed]
    return "\n".join(parts)


def _failure(label: str, run: dict, several_runs: bool) -> str:
    """A failed run in words: its error's last line (a refused run says why it was refused,
    for example that the untrained model already met the target)."""
    lines = (run.get("error") or "").strip().splitlines()
    where = f"{label} run {run['run']}" if several_runs else label
    return f"- {where}: **{run['status']}**, {lines[-1] if lines else 'no error was reported'}"


def plot_training(docs: list[dict], out_dir: Path) -> list[str]:
    """accuracy_vs_time.png and accuracy_vs_steps.png ([] without matplotlib, or without a
    curve, as when every run was refused at step 0)."""
    trained = [d for d in docs if is_training(d)]
    several = len({c["case"] for d in trained for c in d["cases"]}) > 1
    lines = [(_label(doc, case, several) + (f" run {run['run']}" if len(case["runs"]) > 1
                                            else ""), curve)
             for doc in trained for case in doc["cases"] for run in case["runs"]
             if (curve := (run.get("train") or {}).get("curve"))]
    plt = _pyplot() if lines else None
    if plt is None:
        return []
    figs = {axis: plt.subplots(figsize=(7, 4.5)) for axis in ("train_s", "step")}
    target = next((d["train"]["target"] for d in trained if d["train"].get("target")), None)
    for label, curve in lines:
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
