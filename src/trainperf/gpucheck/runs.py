"""Running one case through trainperf's own runner, and what the check keeps of it."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import DataSpec, Measure, Topology, Tuning
from ..plans import layout_for
from ..progress import QuietProgress
from .. import results
from ..recipes import get_recipe
from ..runner import Case as RunnerCase, Plan, Runner
from .cases import Case
from .power import Energy, PowerSampler

TIMING_RTOL = 0.01
"""CUDA events against the host clock around ``synchronize``: the two windows agree within
this."""


def plan_for(case: Case, work: Path, measure: Measure, device: str, tuning: Tuning = Tuning(),
             framework: str = "torch", data: DataSpec | None = None,
             folder: str | None = None) -> Plan:
    recipe = get_recipe(case.recipe)
    # Each framework's own layout on the device (`--memory-format auto`, as `trainperf run`
    # plans it): channels-last for torch on a GPU, where it ran 1.5-2x NCHW on the H200.
    layout = layout_for(framework, tuning.memory_format, device)
    workload = recipe.workload.replace(**{"channels_last": layout, **case.changes})
    cases = [RunnerCase(Topology(1, device=device), workload.batch_size)]
    out = work / "runs" / (folder or case.name)
    return Plan(recipe.name, workload, measure, cases, out, tuning, recipe.reference_model,
                framework, data=data, data_role="real" if data else "synthetic")


def run_plan(plan: Plan) -> dict:
    return Runner(plan, QuietProgress()).run()


def end_times(out_dir: Path) -> dict[int, float]:
    """Unix time of each run's ``end`` event: where its window ended."""
    found = {}
    for line in results.event_lines(out_dir):
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("event") == "end" and "run" in e:
            found[int(e["run"])] = float(e["t"])
    return found


def timing_gap(run: dict) -> float | None:
    """(sum of the window's per-step times - the window's wall time) / the wall time: on a GPU
    the step times come from CUDA events, the window from the host clock."""
    times, window = run.get("step_times_s") or [], run.get("window_s")
    if not times or not window:
        return None
    return (sum(times) - window) / window


def summarise(doc: dict, out_dir: Path, sampler: PowerSampler | None = None) -> dict:
    """One case's figures as the summary shows them (the results folder keeps the rest)."""
    if not doc.get("cases"):
        return {"status": "failed", "error": "no run was recorded", "runs": []}
    c = doc["cases"][0]
    env = doc.get("env") or {}
    ends = end_times(out_dir)
    runs = []
    for r in c["runs"]:
        energy = None
        if r.get("energy_j") and r.get("window_s"):
            # The runner read the boards' energy counter over the window itself: no power
            # readings of this sampler go into it.
            energy = Energy(r["energy_j"], r["energy_j"] / r["window_s"], 0,
                            f"runner: {r['energy_method']}")
        elif sampler is not None and r.get("window_s") and r["run"] in ends:
            energy = sampler.window(ends[r["run"]], r["window_s"])
        runs.append({
            "run": r["run"], "status": r["status"], "samples_per_s": r["samples_per_s"],
            "window_s": r.get("window_s"), "window_samples": r.get("window_samples"),
            "timing_gap": timing_gap(r), "flags": r.get("flags", []),
            "error": (r.get("error") or "")[:300] or None,
            "skipped_steps_in_window": r.get("skipped_steps_in_window"),
            "final_loss_scale": r.get("final_loss_scale"),
            "loss_first": r.get("loss_first"), "loss_last": r.get("loss_last"),
            "window_peak_memory_bytes": r.get("window_peak_memory_bytes"),
            "energy_j": energy.joules if energy else None,
            "mean_power_w": energy.mean_w if energy else None,
            "power_samples": energy.samples if energy else 0,
            "power_method": energy.method if energy else None,
            "samples_per_j": (r["window_samples"] / energy.joules
                              if energy and energy.joules > 0 and r.get("window_samples")
                              and r["status"] == "ok" else None)})
    return {
        "status": "ok" if c.get("median_samples_per_s") else "failed",
        "median_samples_per_s": c.get("median_samples_per_s"),
        "spread": c.get("spread"), "flags": c.get("flags", []),
        "world_size": c["world_size"], "batch_size": c["batch_size_per_device"],
        "precision": c["precision"], "mfu_datasheet": c.get("mfu"),
        "mfu_basis": c.get("mfu_peak_basis"),
        "train_flops_per_sample": c.get("train_flops_per_sample"),
        "train_flops_by_op": c.get("train_flops_by_op"),
        "model_flops_per_s": c.get("model_flops_per_s"),
        "tf32_conv": env.get("tf32_cudnn"), "tf32_matmul": env.get("tf32_matmul"),
        "device_names": env.get("device_names") or [],
        "peak_memory_bytes": c.get("peak_memory_bytes"),
        "window_peak_memory_bytes": max((r["window_peak_memory_bytes"] for r in runs
                                         if r.get("window_peak_memory_bytes")), default=None),
        "predicted_peak_bytes": next((r.get("predicted_peak_bytes") for r in c["runs"]
                                      if r.get("predicted_peak_bytes")), None),
        "memory_model_error": c.get("memory_model_error"),
        "results_dir": str(out_dir), "runs": runs,
        "breakdown": c.get("breakdown"),
    }
