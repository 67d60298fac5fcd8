"""torch's side of a profiled run (``backends.phases``): phase stamps from CUDA events on a GPU
(recorded on the stream, never waited on inside a step) and the host clock on a CPU, where every
op has finished when its call returns; torch's profiler around the profiled steps, whose events
tell which collectives ran inside which phase and whose Chrome trace ``--trace`` keeps."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ..phases import chrome_trace_hint, matmul_rate as timed_matmul_rate, ops_by_phase
from .dist import DistContext
from .step import AMP_DTYPES, TrainStep

RANGE_PREFIX = "trainperf/"
COLLECTIVE_PREFIXES = ("c10d::", "nccl:", "gloo:")
"""The profiler's names of collectives: the dispatched op (``c10d::allreduce_``) and the
backend's own record (``gloo:all_reduce``, ``nccl:all_reduce``)."""


def method(ctx: DistContext, step: TrainStep) -> str:
    clock = ("CUDA events recorded between phases" if ctx.device.type == "cuda"
             else "the host clock between phases (CPU ops finish before their call returns)")
    parts = [f"torch.profiler record_function ranges; {clock}"]
    if step.one_graph:
        parts.append("dp compiled as one graph: the head's forward is in backbone_forward+head, "
                     "its backward in backward")
    elif step.head_with_backbone:
        parts.append("dp under DDP: the head's backward runs in backward")
    if ctx.distributed:
        parts.append("gradient communication not hidden = backward less backward under "
                     "DDP no_sync, alternate steps")
    return "; ".join(parts)


def stamp(device: torch.device) -> Any:
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed(begin: Any, end: Any) -> float:
    if isinstance(begin, float):
        return end - begin
    end.synchronize()
    return begin.elapsed_time(end) / 1000.0


def matmul_rate(device: torch.device, precision: str) -> tuple[float, str]:
    """FLOP/s of torch.mm on the run's device in its precision (TF32 as the run set it)."""
    n = 8192 if device.type == "cuda" else 1024
    dtype = AMP_DTYPES[precision] or torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    fence = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rate = timed_matmul_rate(lambda: torch.mm(a, b), 2.0 * n**3, fence)
    return rate, f"torch.mm {str(dtype).removeprefix('torch.')} {n}^3"


class Profiler:
    """torch.profiler over the profiled steps. On exit, the worker's ``collectives`` (per phase,
    the collective ops that started inside its range) and, with ``trace_dir``, rank 0's Chrome
    trace (each rank writes its own)."""

    def __init__(self, run: Any, trace_dir: str | None) -> None:
        self.run, self.trace_dir = run, trace_dir
        activities = [torch.profiler.ProfilerActivity.CPU]
        if run.ctx.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities)

    def __enter__(self) -> "Profiler":
        self.prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prof.__exit__(*exc)
        if exc[0] is not None:
            return
        self.run.collectives = collectives_by_phase(self.prof.events())
        if self.trace_dir:
            os.makedirs(self.trace_dir, exist_ok=True)
            path = os.path.join(self.trace_dir, f"torch-trace-rank{self.run.rank}.json")
            self.prof.export_chrome_trace(path)
            if self.run.rank == 0:
                self.run.trace = path
                self.run.trace_open = chrome_trace_hint(path)


def collectives_by_phase(events: Any) -> dict[str, list[str]]:
    """{phase: names of the collective ops that started inside one of its ranges}."""
    ranges = []
    ops = []
    for e in events:
        name = e.name
        if name.startswith(RANGE_PREFIX):
            ranges.append((e.time_range.start, e.time_range.end, name[len(RANGE_PREFIX):]))
        elif name.startswith(COLLECTIVE_PREFIXES):
            ops.append((e.time_range.start, name))
    return ops_by_phase(ranges, ops)
