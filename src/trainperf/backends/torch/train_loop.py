"""Training to a verification accuracy: the time-to-accuracy scenario of the torch backend.

The steps are the throughput run's (``TrainStep``) on real data; every ``eval_every`` steps
rank 0 evaluates the backbone on the verification sets and tells every rank the accuracy, so
that all decide alike whether the target is met, and every ``checkpoint_every`` steps all ranks
write a checkpoint (``checkpoint.py``). Evaluation and checkpoints happen between
synchronisations, outside every step's time, so the training time is the sum of the step times
alone.

A run that finds a checkpoint in its folder goes on from it, on any number of ranks: the class
matrix is resharded, the learning-rate schedule continues from the saved step, and the input
stream continues after the samples already trained on. Every random draw of a step (dropout,
Partial FC's negatives) is seeded by (seed, step, rank), so a run resumed on the same ranks
trains exactly as one that never stopped.

The untrained model is evaluated first, before the input pipeline starts: where it already
meets the target, the run is refused (``TargetMetBeforeTraining``), as no step could take any
time to reach it and the verification set cannot tell a model that learns from one that does
not.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ...data.binset import read_bin
from ...faults import inject, parse_faults
from ...protocol import End, Eval, EventWriter, RunSpec, Step
from . import checkpoint
from .backend import BACKEND
from .data import real_feed
from .dist import DistContext
from .evaluation import evaluate_sets
from .step import TrainStep
from .timing import make_timer
from .runtime import (configure_backend, current_memory, emit_start, memory_over_ranks,
                      peak_memory)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one rank's draws at one step (ints hash the same in every process)."""
    return hash((seed, step, rank)) & 0xFFFF_FFFF_FFFF


def fresh_progress() -> dict:
    return {"step": 0, "samples": 0, "train_s": 0.0, "elapsed_s": 0.0, "curve": [],
            "reached": None, "stopped_by": None, "resumed_from_steps": [],
            "loss_first": None, "loss_last": None}


class TargetMetBeforeTraining(ValueError):
    """The untrained model already meets the target: there is no time to accuracy to measure."""


def _refusal(accuracy: float, target: float, set_name: str) -> TargetMetBeforeTraining:
    """The one-line error of a run whose untrained model verifies ``accuracy`` already."""
    return TargetMetBeforeTraining(
        f"the untrained model already verifies {accuracy:.1%} of {set_name}'s pairs at step 0, "
        f"at or above the target {target:.1%}, so this verification set cannot measure time to "
        f"accuracy: evaluate on harder pairs (a real set such as lfw.bin, or one written by "
        f"`trainperf data synth`) or set --target above {accuracy:.1%}")


def _score(step: TrainStep, sets: list, plan, ctx: DistContext
           ) -> tuple[dict[str, dict], float, float]:
    """One evaluation: rank 0's figures of every set (none on the other ranks), the first
    set's accuracy on every rank (so that every rank takes the same decision from it), and the
    seconds it took."""
    begin = time.perf_counter()
    results: dict[str, dict] = {}
    accuracy = 0.0
    if ctx.rank == 0:
        results = evaluate_sets(step.backbone, sets, ctx.device, plan.eval_batch_size,
                                plan.far)
        accuracy = results[sets[0].name]["accuracy"]
    if ctx.distributed:
        t = torch.tensor([accuracy], dtype=torch.float64, device=ctx.device)
        dist.broadcast(t, 0, group=ctx.group)
        accuracy = float(t.item())
    return results, accuracy, time.perf_counter() - begin


def train(spec: RunSpec, events: EventWriter, ctx: DistContext) -> None:
    workload, plan = spec.workload, spec.train
    assert plan is not None
    if spec.data is None:
        raise ValueError("training to accuracy reads real data: the spec needs data")
    baseline = current_memory(ctx.device)
    # Read the verification sets before anything costly: a bad file fails the run at once.
    sets = ([read_bin(p, size=workload.input_size) for p in plan.val]
            if ctx.rank == 0 else [])
    configure_backend(spec.tuning, ctx.device)
    # Not through workerkit's measured run, which resolves the mode for the others.
    mode = BACKEND.resolve_mode(spec.tuning.mode, ctx.device.type)
    step = TrainStep(workload, ctx, spec.tuning, mode=mode)
    progress = fresh_progress()
    found = checkpoint.step_dirs(plan.checkpoint_dir) if plan.checkpoint_dir else []
    if found:
        progress = checkpoint.load(found[-1], step, ctx)
        progress["resumed_from_steps"] = [*progress["resumed_from_steps"], progress["step"]]
    opening = None
    if progress["step"] == 0:
        # Where the curve starts, measured before the input pipeline starts: a set that the
        # untrained model passes already costs one evaluation to refuse, not the loader's
        # start-up, and leaves no time or steps to target that no step took.
        opening = _score(step, sets, plan, ctx)
        if opening[1] >= plan.target:
            raise _refusal(opening[1], plan.target, Path(plan.val[0]).stem)
    global_batch = workload.batch_size * ctx.world_size
    feed, input_info = real_feed(spec.data, workload, ctx,
                                 start=progress["samples"] // ctx.world_size)
    emit_start(events, ctx, step, baseline, input_info, mode=mode,
               resumed_from_step=progress["step"] if found else None)

    timer = make_timer(ctx.device)
    first_step = progress["step"]
    warmup_end = first_step + spec.measure.warmup  # each attempt warms up again
    waits: dict[int, float] = {}
    times: list[tuple[int, float]] = []
    losses: list[torch.Tensor] = []
    nonfinite = 0
    attempt_start = time.perf_counter()
    elapsed_before = progress["elapsed_s"]

    def record(done: list[tuple[int, float]]) -> None:
        for index, seconds in done:
            times.append((index, seconds))
            progress["train_s"] += seconds
            if ctx.rank == 0:
                events.emit(Step(index=index, seconds=seconds, samples=global_batch,
                                 warmup=index < warmup_end, data_wait_s=waits.pop(index, None)))

    def evaluate(s: int, segment_losses: list[float], scored=None) -> bool:
        """Evaluate at step ``s`` (or take ``scored``, the evaluation made there already),
        record it, and tell whether the target is met."""
        results, accuracy, eval_s = scored or _score(step, sets, plan, ctx)
        reached = accuracy >= plan.target
        if ctx.rank == 0:
            finite = [v for v in segment_losses if math.isfinite(v)]
            entry = {"step": s, "samples": progress["samples"], "train_s": progress["train_s"],
                     "eval_s": eval_s,
                     "sets": {name: {k: r[k] for k in ("pairs", "accuracy", "accuracy_std",
                                                         "tar", "far")}
                              for name, r in results.items()},
                     "accuracy": accuracy, "reached": reached,
                     "loss": sum(finite) / len(finite) if finite else None}
            progress["curve"].append(entry)
            events.emit(Eval(**entry))
        if reached and progress["reached"] is None:
            progress["reached"] = {"step": s, "train_s": progress["train_s"],
                                   "samples": progress["samples"]}
        return reached

    s = first_step
    # An earlier attempt met the target and saved, but did not live to report it.
    stop = progress["stopped_by"] == "target"
    if opening is not None:
        evaluate(0, [], opening)  # below the target, or the run was refused above
    faults = parse_faults(ctx.world_size)
    timer.start()
    while not stop and s < plan.max_steps:
        inject(faults, s, ctx.rank, lambda msg: torch.OutOfMemoryError(f"CUDA {msg}"))
        torch.manual_seed(step_seed(workload.seed, s, ctx.rank))
        images, labels = next(feed)
        waits[s] = feed.last_wait_s
        losses.append(step(images, labels))
        timer.mark(s)
        record(timer.drain())
        s += 1
        progress["samples"] += global_batch
        last = s == plan.max_steps
        due_eval = s % plan.eval_every == 0 or last
        if not (due_eval or s % plan.save_every == 0):
            continue
        timer.sync()  # deliberate: evaluation and saving stay out of every step's time
        record(timer.drain(wait=True))
        progress["step"] = s
        reached = False
        if due_eval:
            values = torch.stack(losses).double().tolist()
            losses.clear()
            nonfinite += sum(not math.isfinite(v) for v in values)
            if progress["loss_first"] is None:
                progress["loss_first"] = values[0]
            progress["loss_last"] = values[-1]
            reached = evaluate(s, values)
        if reached:
            progress["stopped_by"] = "target"
        elif last:
            progress["stopped_by"] = "max_steps"
        progress["elapsed_s"] = elapsed_before + time.perf_counter() - attempt_start
        if plan.checkpoint_dir and (s % plan.save_every == 0 or reached or last):
            checkpoint.save(plan.checkpoint_dir, step, ctx, progress, plan.keep_checkpoints)
        stop = reached
        timer.start()
    feed.close()
    memory = memory_over_ranks(peak_memory(ctx.device), ctx)
    if ctx.rank == 0:
        events.emit(_end(progress, plan, times, warmup_end, global_batch, nonfinite,
                         step, baseline, memory, sets[0].name))
    if ctx.distributed:
        dist.barrier(group=ctx.group)


def _end(progress: dict, plan, times: list[tuple[int, float]], warmup_end: int,
         global_batch: int, nonfinite: int, step: TrainStep, baseline: int, memory: dict,
         target_set: str) -> End:
    """The run's end: its throughput (this attempt's steps after its warm-up, or all of them
    when it ran no more), and the training outcome."""
    counted = [t for i, t in times if i >= warmup_end] or [t for _, t in times]
    window_s = sum(counted)
    reached = progress["reached"] or {}
    loss_last = progress["loss_last"]
    return End(
        samples_per_s=len(counted) * global_batch / window_s if window_s > 0 else 0.0,
        window_s=window_s, window_samples=len(counted) * global_batch,
        window_steps=len(counted),
        loss_first=progress["loss_first"] if progress["loss_first"] is not None else math.nan,
        loss_last=loss_last if loss_last is not None else math.nan,
        nonfinite_losses=nonfinite,
        skipped_steps_in_window=sum(i >= warmup_end for i in step.skipped_steps),
        final_loss_scale=step.loss_scale, baseline_memory_bytes=baseline, **memory,
        train={"stopped_by": progress["stopped_by"], "target": plan.target,
               "target_set": target_set, "steps": progress["step"],
               "samples": progress["samples"], "train_s": progress["train_s"],
               "elapsed_s": progress["elapsed_s"],
               "time_to_target_s": reached.get("train_s"),
               "steps_to_target": reached.get("step"),
               "samples_to_target": reached.get("samples"),
               "best_accuracy": max((e["accuracy"] for e in progress["curve"]), default=None),
               "resumed_from_steps": progress["resumed_from_steps"],
               "curve": progress["curve"]})
