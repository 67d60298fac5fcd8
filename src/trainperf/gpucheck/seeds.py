"""The case stages (the headline cases, the rest of the seeds' table) on one device, each case
beside DLPerf's V100 row.

Every case runs through trainperf's own runner (2 runs of 40 iterations, 10 of warm-up on a
GPU) while the GPU's power is sampled, so each case also gets samples per joule, and every run
keeps its peak memory beside the memory model's prediction.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from .. import references
from ..config import Tuning
from ..recipes import get_recipe
from ..report.references import published_mfu
from ..stats import median
from . import cases
from .power import PowerSampler
from .record import StageLog
from .runs import plan_for, run_plan, summarise


def published(case: cases.Case, flops_by_op: dict | None, flops: float | None) -> dict | None:
    """The fastest published 1-GPU row of the same model, mode and batch: in the case's own
    precision where DLPerf measured it, else in fp32 (said so)."""
    recipe = get_recipe(case.recipe)
    workload = recipe.workload.replace(**case.changes)
    for precision in dict.fromkeys((workload.precision, "fp32")):
        rows = references.matching(recipe.reference_model, recipe.reference_mode, workload.fc,
                                   workload.sample_ratio, precision, workload.batch_size, 1)
        if rows:
            best = max(rows, key=lambda r: r.samples_per_s)
            return {"framework": best.framework, "precision": best.precision,
                    "samples_per_s": best.samples_per_s, "mode": best.mode,
                    "source": best.source.split(" ; ")[0],
                    "mfu": published_mfu(best, flops, flops_by_op),
                    "same_precision": precision == workload.precision}
    return None


def run(log: StageLog, mode: str, work: Path, stage_id: str) -> None:
    device = cases.device(mode)
    sampler_cm = PowerSampler() if mode == "gpu" else contextlib.nullcontext(None)
    with sampler_cm as sampler:
        log.set(power=(sampler.method if sampler else None))
        if sampler is None:
            log.note("samples per joule: not measured (the CPU mode reads no GPU power)")
        elif sampler.method is None:
            log.note("samples per joule: not measured (neither NVML, through nvidia-ml-py, "
                     "nor nvidia-smi is available)")
        for case in cases.stage_cases(stage_id, mode):
            plan = plan_for(case, work, cases.measure(mode, stage_id), device,
                            Tuning(**case.tuning))
            if mode == "gpu" and case.label in cases.BREAKDOWN_CASES:
                plan.profile_steps = cases.BREAKDOWN_STEPS
            got = summarise(run_plan(plan), plan.out_dir, sampler)
            per_joule = [r["samples_per_j"] for r in got["runs"] if r.get("samples_per_j")]
            got.update(label=case.label, recipe=case.recipe, changes=case.changes,
                       tuning=case.tuning,
                       samples_per_j=median(per_joule) if per_joule else None,
                       dlperf=published(case, got.get("train_flops_by_op"),
                                        got.get("train_flops_per_sample")))
            if sampler is not None and sampler.error:
                got["power_error"] = sampler.error
            log.add("case", **got)
            rate = got.get("median_samples_per_s")
            print(f"{case.label}: {f'{rate:.1f} samples/s' if rate else got['status']}",
                  flush=True)
