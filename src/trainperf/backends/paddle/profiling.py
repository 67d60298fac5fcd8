"""Paddle's side of a profiled run (``backends.phases``): phases as ``paddle.profiler.RecordEvent``
ranges, closed by the worker's default stamp (``paddle.device.synchronize`` on a GPU, nothing to
wait for on a CPU, where Paddle's dynamic graph has finished every op when its call returns)
and the host clock; ``paddle.profiler.Profiler`` around the profiled steps, whose Chrome trace
``--trace`` keeps."""

from __future__ import annotations

import os
from typing import Any

import paddle
import paddle.profiler as profiler

from ..phases import chrome_trace_hint, matmul_rate as timed_matmul_rate
from .backend import STATIC
from .comm import Comm
from .step import AMP_DTYPES, TrainStep

RANGE_PREFIX = "trainperf/"


def method(comm: Comm, step: TrainStep) -> str:
    clock = ("paddle.device.synchronize and the host clock between phases"
             if comm.device_type == "gpu" else
             "the host clock between phases (Paddle's CPU ops finish before their call returns)")
    parts = [f"paddle.profiler RecordEvent ranges; {clock}"]
    if step.mode == STATIC:
        parts.append("backbone_forward and backward are the backbone's static programs")
    if step.head is not None:
        parts.append("the head's hand-written backward to the embeddings runs in head")
    if comm.distributed:
        parts.append("the gradient all-reduce is an explicit call after the backward (no "
                     "overlap): grad_comm is all of it")
    return "; ".join(parts)


def annotate(name: str) -> profiler.RecordEvent:
    return profiler.RecordEvent(RANGE_PREFIX + name)


def matmul_rate(comm: Comm, precision: str) -> tuple[float, str]:
    """FLOP/s of paddle.matmul on the run's device in its precision."""
    gpu = comm.device_type == "gpu"
    n = 8192 if gpu else 1024
    dtype = AMP_DTYPES.get(precision) or "float32"
    a = paddle.randn([n, n]).astype(dtype)
    b = paddle.randn([n, n]).astype(dtype)
    fence = paddle.device.synchronize if gpu else (lambda: None)
    rate = timed_matmul_rate(lambda: paddle.matmul(a, b), 2.0 * n**3, fence)
    return rate, f"paddle.matmul {dtype} {n}^3"


class Profiler:
    """paddle.profiler over the profiled steps; with ``trace_dir``, each rank's Chrome trace
    there, rank 0's named in the run's ``trace``."""

    def __init__(self, run: Any, trace_dir: str | None) -> None:
        self.run, self.trace_dir = run, trace_dir
        targets = [profiler.ProfilerTarget.CPU]
        if run.comm.device_type == "gpu":
            targets.append(profiler.ProfilerTarget.GPU)
        # Paddle's default on_trace_ready writes a trace into ./profiler_log of the working
        # directory whether asked or not; the trace is written below, where it is asked for.
        self.prof = profiler.Profiler(targets=targets, on_trace_ready=lambda _: None)

    def __enter__(self) -> "Profiler":
        self.prof.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prof.stop()
        if exc[0] is not None or not self.trace_dir:
            return
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"paddle-trace-rank{self.run.rank}.json")
        self.prof.export(path, format="json")
        if self.run.rank == 0:
            self.run.trace = path
            self.run.trace_open = chrome_trace_hint(path)
