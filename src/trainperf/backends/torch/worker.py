"""Entry point of one measured run, started on every rank by ``trainperf.backends.spawn``.

It follows ``trainperf.protocol`` (spec in, JSON-line events out): rank 0 writes ``start``, one
``step`` per step and ``end``; any rank that fails writes an ``error`` (kind ``oom`` or
``exception``). The runner alone decides a run's status from these lines and the exit code.

For tests, TRAINPERF_FAULT injects failures at steps (``trainperf.faults``).
"""

from __future__ import annotations

import argparse
import os
import resource

import torch
import torch.distributed as dist

from ...faults import inject, parse_faults
from ..workerkit import leave
from ...protocol import End, Error, EventWriter, RunSpec, Start, Step
from ...config import Tuning, Workload
from .alignment import load_start
from .data import real_feed, synthetic_batch
from .dist import DistContext, all_gather, init_from_env
from .env import framework_env
from .flops import backbone_profile, train_flops_per_sample
from .memory_model import estimate
from .step import TrainStep
from .timing import make_timer, timed_loop


def is_oom(exc: BaseException, memory_capped: bool = False) -> bool:
    """``memory_capped``: the process runs under ``--memory-limit``, where oneDNN reports an
    allocation the cap refused as a primitive it could not create (seen in capacity searches
    on CPU); without a cap that message means something else."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    # std::bad_alloc: C++ code's allocation failed (seen under a capacity search's cap, from
    # an allocation outside torch's allocator).
    return "out of memory" in text or "can't allocate memory" in text or (
        "defaultcpuallocator" in text) or "bad_alloc" in text or (
        memory_capped and "could not create a primitive" in text)


def current_memory(device: torch.device) -> int:
    """Memory in use now: allocated device memory, or this process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def limit_memory(limit_bytes: int | None, device: torch.device) -> None:
    """Cap this process's data segment (heap and anonymous mappings: what tensors use) so a CPU
    run that needs more fails with an allocation error instead of taking the machine down. On a
    GPU the device's own capacity is the limit."""
    if limit_bytes and device.type == "cpu":
        resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))


def peak_memory(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {"peak_memory_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    # ru_maxrss is in KiB on Linux.
    return {"peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def memory_over_ranks(values: dict[str, int], ctx: DistContext) -> dict:
    """The largest of each figure across ranks, and every rank's peak."""
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=ctx.device)
    per_rank = all_gather(t[None], ctx)
    out: dict = {k: int(v) for k, v in zip(values, per_rank.max(dim=0).values.tolist())}
    out["peak_memory_bytes_per_rank"] = [int(v) for v in per_rank[:, 0].tolist()]
    return out


def waits_over_ranks(window_wait_s: float, ctx: DistContext) -> list[float]:
    """Every rank's seconds of the window spent waiting for batches."""
    t = torch.tensor([[window_wait_s]], dtype=torch.float64, device=ctx.device)
    return all_gather(t, ctx)[:, 0].tolist()


def classes_computed(workload: Workload, step: TrainStep, ctx: DistContext) -> int:
    """Classes each sample's logits are computed over, summed over shards."""
    head = step.head
    if head is None or not head.sampling:
        return workload.num_classes
    return head.num_sample * ctx.world_size


def configure_backend(tuning: Tuning, device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = tuning.cudnn_benchmark
        if tuning.tf32 != "default":
            on = tuning.tf32 == "on"
            torch.backends.cudnn.allow_tf32 = on
            torch.backends.cuda.matmul.allow_tf32 = on


def step_settings(step: TrainStep, device: torch.device) -> dict:
    """The speed settings this run's step actually runs with."""
    return {"cudnn_benchmark": torch.backends.cudnn.benchmark if device.type == "cuda" else None,
            "ddp": step.ddp_settings,
            "loss_scaling": "dynamic, one overflow decision for all ranks"
            if step.workload.precision == "fp16" else None}


def emit_start(events: EventWriter, ctx: DistContext, step: TrainStep, baseline: int,
               input_info: dict | None, **settings) -> None:
    """Rank 0's ``start`` event: what runs, and what the worker predicts of it."""
    if ctx.rank != 0:  # only rank 0 reports; rank 0 also holds the largest class shard
        return
    workload = step.workload
    params, fwd_flops = backbone_profile(
        workload.backbone, workload.input_size, embedding_size=workload.embedding_size,
        num_classes=workload.num_classes, output_block=workload.output_block)
    flops = train_flops_per_sample(
        fwd_flops, workload.embedding_size if workload.task == "face" else 0,
        classes_computed(workload, step, ctx))
    model = estimate(workload, ctx.world_size, ctx.rank, params, ctx.device.type)
    events.emit(Start(
        world_size=ctx.world_size, global_batch=workload.batch_size * ctx.world_size,
        device=str(ctx.device), env=framework_env(ctx.device), workload=workload.to_dict(),
        settings={**step_settings(step, ctx.device), "input": input_info, **settings},
        backbone_params=params,
        train_flops_per_sample=sum(flops.values()), train_flops_by_op=flops,
        pfc_update=step.pfc_update, baseline_memory_bytes=baseline,
        predicted_peak_bytes=baseline + model.total_bytes, memory_model=model.to_dict()))


def run(spec: RunSpec, events: EventWriter, ctx: DistContext) -> None:
    workload, measure = spec.workload, spec.measure
    baseline = current_memory(ctx.device)
    limit_memory(measure.memory_limit_bytes, ctx.device)
    configure_backend(spec.tuning, ctx.device)
    step = TrainStep(workload, ctx, spec.tuning)
    feed, input_info = None, None
    if spec.data:
        feed, input_info = real_feed(spec.data, workload, ctx)
    elif spec.init:
        images, labels = load_start(step, spec.init, ctx)
    else:
        images, labels = synthetic_batch(workload, ctx)
    global_batch = workload.batch_size * ctx.world_size
    emit_start(events, ctx, step, baseline, input_info)
    faults = parse_faults(ctx.world_size)
    waits: list[float] = []

    def one_step() -> torch.Tensor:
        inject(faults, step.step_index, ctx.rank,
               lambda msg: torch.OutOfMemoryError(f"CUDA {msg}"))
        if feed is None:
            return step(images, labels)
        batch = next(feed)
        waits.append(feed.last_wait_s)
        return step(*batch)

    timed: list[int] = []

    def on_steps(done: list[tuple[int, float]]) -> None:
        timed.extend(index for index, _ in done)
        if ctx.rank == 0:
            for index, seconds in done:
                events.emit(Step(index=index, seconds=seconds, samples=global_batch,
                                 warmup=index < measure.warmup,
                                 data_wait_s=waits[index] if feed else None))

    barrier = (lambda: dist.barrier(group=ctx.group)) if ctx.distributed else (lambda: None)
    window_s, losses = timed_loop(one_step, measure.iters, measure.warmup,
                                  make_timer(ctx.device), on_steps, barrier)
    assert timed == list(range(measure.iters)), "every step must have its time, in order"
    # Read-backs after the window: the losses, and the loss scale (a device value).
    loss_values = torch.stack(losses).float().tolist()
    loss_scale = step.loss_scale
    memory = memory_over_ranks(peak_memory(ctx.device), ctx)
    waited = {}
    if feed is not None:
        feed.close()
        waited["data_wait_s_per_rank"] = waits_over_ranks(sum(waits[measure.warmup:]), ctx)
    if ctx.rank == 0:
        events.emit(End.of_window(window_s, measure, global_batch, loss_values,
                                  step.skipped_steps, final_loss_scale=loss_scale,
                                  baseline_memory_bytes=baseline, **memory, **waited))
    # A fault planned at step ``iters`` strikes after the last step, as a crash at teardown.
    inject(faults, measure.iters, ctx.rank, lambda msg: torch.OutOfMemoryError(f"CUDA {msg}"))
    if ctx.distributed:
        # No rank tears its process group down while another still talks to it.
        dist.barrier(group=ctx.group)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, help="JSON file: workload, measure, device")
    parser.add_argument("--events", required=True, help="JSON-lines file to append events to")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    events = EventWriter(args.events, rank)
    ctx = spec = None
    try:
        spec = RunSpec.load(args.spec)
        if spec.threads:
            torch.set_num_threads(spec.threads)
        ctx = init_from_env(spec.device)
        if spec.train is not None:
            from .train_loop import train  # the time-to-accuracy scenario

            train(spec, events, ctx)
        else:
            run(spec, events, ctx)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes an event
        capped = spec is not None and spec.measure.memory_limit_bytes is not None
        error = Error.of_exception(exc, is_oom(exc, capped))
        events.emit(error)
        return error.exit_code
    finally:
        if ctx is not None and ctx.distributed and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())
