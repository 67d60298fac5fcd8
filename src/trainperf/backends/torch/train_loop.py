"""Training to a verification accuracy: the time-to-accuracy scenario of the torch backend.

The steps are the throughput run's (``TrainStep``) on real data; every ``eval_every`` steps
rank 0 evaluates the backbone on the verification sets and tells every rank whether the target
is met, and every ``checkpoint_every`` steps all ranks write a checkpoint (``checkpoint.py``).
Evaluation and checkpoints happen between synchronisations, outside every step's time, so the
training time is the sum of the step times alone.

A run that finds a checkpoint in its folder goes on from it, on any number of ranks: the class
matrix is resharded, the learning-rate schedule continues from the saved step, and the input
stream continues after the samples already trained on. Every random draw of a step (dropout,
Partial FC's negatives) is seeded by (seed, step, rank), so a run resumed on the same ranks
trains exactly as one that never stopped.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ...data.binset import read_bin
from ...faults import inject, parse_faults
from ...protocol import End, Eval, EventWriter, RunSpec, Step
from . import checkpoint
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


def _agree(flag: bool, ctx: DistContext) -> bool:
    """Rank 0's decision, on every rank."""
    if not ctx.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    dist.broadcast(t, 0, group=ctx.group)
    return bool(t.item())


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
    step = TrainStep(workload, ctx, spec.tuning)
    progress = fresh_progress()
    found = checkpoint.step_dirs(plan.checkpoint_dir) if plan.checkpoint_dir else []
    if found:
        progress = checkpoint.load(found[-1], step, ctx)
        progress["resumed_from_steps"] = [*progress["resumed_from_steps"], progress["step"]]
    global_batch = workload.batch_size * ctx.world_size
    feed, input_info = real_feed(spec.data, workload, ctx,
                                 start=progress["samples"] // ctx.world_size)
    emit_start(events, ctx, step, baseline, input_info,
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

    def evaluate(s: int, segment_losses: list[float]) -> bool:
        begin = time.perf_counter()
        reached = False
        results: dict[str, dict] = {}
        if ctx.rank == 0:
            results = evaluate_sets(step.backbone, sets, ctx.device, plan.eval_batch_size,
                                    plan.far)
            reached = results[sets[0].name]["accuracy"] >= plan.target
        reached = _agree(reached, ctx)
        if ctx.rank == 0:
            finite = [v for v in segment_losses if math.isfinite(v)]
            entry = {"step": s, "samples": progress["samples"], "train_s": progress["train_s"],
                     "eval_s": time.perf_counter() - begin,
                     "sets": {name: {k: r[k] for k in ("pairs", "accuracy", "accuracy_std",
                                                         "tar", "far")}
                              for name, r in results.items()},
                     "accuracy": results[sets[0].name]["accuracy"], "reached": reached,
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
    if s == 0:
        # The untrained model's accuracy: where the curve starts, and what the target must
        # be above for the run to mean anything.
        stop = evaluate(0, [])
        if stop:
            progress["stopped_by"] = "target"
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
