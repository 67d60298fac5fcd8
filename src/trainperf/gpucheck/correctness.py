"""GPU correctness (part 1): does the GPU compute what the CPU computes, and are its clocks
and counters right?

- The tiny recipe in ``dp``, ``mp`` and ``pfc`` at ratio 1.0 (the same arithmetic as ``mp``)
  starts from one start file (``trainperf align``'s) on the GPU, in fp32 with TF32 off, and its
  losses must agree with the CPU's within ``align``'s tolerances. The CPU side runs once, in
  ``dp``: on one device the three heads compute the same softmax (the H200 record's three CPU
  runs gave identical losses, bit for bit), and every CPU process is seconds of a lent
  machine's minutes.
- fp16 and bf16 runs must give finite losses; fp16's skipped steps and final loss scale are
  kept.
- The window's time from CUDA events (the sum of its steps) and from the host clock around
  ``synchronize`` must agree within 1%, over those two runs.
- Every run's peak memory from torch's allocator is kept beside the memory model's prediction.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..align import FIRST_LOSS_RTOL, LATER_LOSS_RTOL, compare_losses, run_from_start
from ..backends.torch.alignment import write_start
from ..config import AlignSpec, Measure, Tuning
from ..recipes import get_recipe
from ..report.markdown import gib
from . import cases
from .record import FAIL, PASS, RECORDED, StageLog
from .runs import TIMING_RTOL, plan_for, run_plan, summarise

RECIPE = "tiny-arcface"
ALIGN_STEPS = 5
ALIGN_HEADS = {"gpu": ("dp", "mp", "pfc"), "cpu": ("dp",)}
"""The CPU mode's 'device' is the CPU again, so one head is enough to check the comparison
itself; four fewer runs (the suite aligns every head with torch elsewhere)."""
PRECISION_MEASURE = {"gpu": Measure(runs=1, iters=25, warmup=5, timeout_s=120),
                     "cpu": Measure(runs=1, iters=6, warmup=2, timeout_s=120)}
SIZE = {"gpu": {}, "cpu": {"input_size": 32}}
"""The recipe's 112 pixels on a GPU; 32 in the CPU mode, as its tiny cases: the same layers, a
step several times cheaper (fp16's most, which a CPU emulates)."""


def align_on_device(log: StageLog, mode: str, work: Path) -> None:
    device = cases.device(mode)
    # dropout off: masks cannot match across devices
    base = get_recipe(RECIPE).workload.replace(dropout=0.0, **SIZE[mode])
    init = work / "correctness" / "start.npz"
    write_start(base, 1, init)
    aside = "" if mode == "gpu" else " (CPU mode: both sides run on the CPU, so this checks " \
                                     "the comparison, not a device)"
    start = AlignSpec(str(init))
    cpu = run_from_start(RECIPE, base.replace(fc="dp"), start, work / "runs" / "align-cpu",
                         ALIGN_STEPS, 120, device="cpu")
    for fc in ALIGN_HEADS[mode]:
        workload = base.replace(fc=fc)
        where = work / "runs" / f"align-{fc}"
        dev = run_from_start(RECIPE, workload, start, where / "device", ALIGN_STEPS, 120,
                             device=device, tuning=Tuning(tf32="off"))
        ref, ref_params, got, got_params = cpu.record, cpu.params, dev.record, dev.params
        verdict = compare_losses(ref.get("losses"), got.get("losses"), ref_params, got_params)
        for side, rec in (("CPU (dp)", ref), (device, got)):
            if rec.get("status") != "ok":
                verdict["problems"].insert(0, f"{side} run {rec.get('status')}: "
                                              f"{(rec.get('error') or '')[:200]}")
        ok = not verdict["problems"]
        first, worst = verdict["first_loss_rel_diff"], verdict["max_loss_rel_diff"]
        figures = (f"first loss {first:.1e}, worst {worst:.1e} apart (relative; limits "
                   f"{FIRST_LOSS_RTOL:g}, {LATER_LOSS_RTOL:g}) over {ALIGN_STEPS} steps"
                   if first is not None else "")
        detail = "; ".join(filter(None, [figures, *verdict["problems"]])) + aside
        log.check(f"{fc}{' 1.0' if fc == 'pfc' else ''}: losses on {device} match the CPU's",
                  PASS if ok else FAIL, detail,
                  first_loss_rel_diff=verdict["first_loss_rel_diff"],
                  max_loss_rel_diff=verdict["max_loss_rel_diff"],
                  tolerance={"first": FIRST_LOSS_RTOL, "later": LATER_LOSS_RTOL},
                  losses_cpu=ref.get("losses"), losses_device=got.get("losses"),
                  params_cpu=ref_params, params_device=got_params)
        memory(log, f"align {fc}", got)


def memory(log: StageLog, label: str, run: dict) -> None:
    peak, predicted = run.get("peak_memory_bytes"), run.get("predicted_peak_bytes")
    error = (predicted - peak) / peak if peak and predicted else None
    log.check(f"peak memory vs model: {label}", RECORDED,
              f"peak {gib(peak)}, model {gib(predicted)} ({100 * error:+.1f}%)"
              if error is not None else "no peak or no prediction was recorded",
              peak_bytes=peak, predicted_bytes=predicted, model_error=error)


def precisions(log: StageLog, mode: str, work: Path) -> list[dict]:
    device = cases.device(mode)
    measured = []
    for precision in ("fp16", "bf16"):
        case = cases.Case(f"tiny dp {precision}", RECIPE, {"precision": precision, **SIZE[mode]})
        plan = plan_for(case, work, PRECISION_MEASURE[mode], device,
                        folder=f"precision-{precision}")
        got = summarise(run_plan(plan), plan.out_dir)
        measured.append(got)
        run = got["runs"][0] if got["runs"] else {}
        finite = (run.get("status") == "ok" and "loss_nonfinite" not in run.get("flags", [])
                  and run.get("loss_last") is not None and math.isfinite(run["loss_last"]))
        detail = (f"losses from {run['loss_first']:.4f} to {run['loss_last']:.4f}"
                  if finite else f"run {run.get('status')}: flags {run.get('flags')} "
                                 f"{run.get('error') or ''}")
        if precision == "fp16":
            detail += (f"; {run.get('skipped_steps_in_window')} step(s) skipped in the window, "
                       f"final loss scale {run.get('final_loss_scale')}")
        log.check(f"{precision} on {device}: losses finite", PASS if finite else FAIL, detail,
                  loss_first=run.get("loss_first"), loss_last=run.get("loss_last"),
                  skipped_steps_in_window=run.get("skipped_steps_in_window"),
                  final_loss_scale=run.get("final_loss_scale"), flags=run.get("flags"))
    return measured


def timing(log: StageLog, mode: str, measured: list[dict]) -> None:
    name = "window: CUDA events vs host clock"
    if mode != "gpu":
        log.not_run(name, "CUDA events exist only on a GPU (on the CPU a step's time is the "
                          "host clock's)")
        return
    gaps = [r["timing_gap"] for m in measured for r in m["runs"]
            if r.get("timing_gap") is not None]
    if not gaps:
        log.check(name, FAIL, "no run gave both figures")
        return
    worst = max(gaps, key=abs)
    log.check(name, PASS if abs(worst) <= TIMING_RTOL else FAIL,
              f"largest gap {100 * worst:+.3f}% over {len(gaps)} runs (limit "
              f"{100 * TIMING_RTOL:g}%)", gaps=gaps, worst=worst)


def run(log: StageLog, mode: str, work: Path) -> None:
    align_on_device(log, mode, work)
    measured = precisions(log, mode, work)
    timing(log, mode, measured)
    for m in measured:
        memory(log, f"tiny dp {m['precision']}",
               {"peak_memory_bytes": m["peak_memory_bytes"],
                "predicted_peak_bytes": m["predicted_peak_bytes"]})
