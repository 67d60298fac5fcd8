"""OneFlow's side of a profiled run (``backends.phases``).

Stamps: OneFlow queues every eager operation on its virtual machine, on a CPU too, so each phase
is closed by the worker's ``sync`` (``Dist.sync``: the virtual machine drained, and the GPU
synchronised on one) and the host clock, the default ``phase_stamp``.

Named ranges: ``oneflow.profiler.range_push``/``range_pop``, OneFlow's NVTX ranges, which Nsight
Systems shows on a GPU and which cost nothing where no tool listens. OneFlow's own profiler
(``oneflow.profiler.profile`` with ``record_function``) cannot be used: in the 0.9.0 wheel,
a CUDA build, leaving ``profile`` calls ``cudaDeviceSynchronize`` whatever the activities, and on
a machine without a CUDA driver that check aborts the process (measured); ``record_function``
outside ``profile`` raises. Where it runs, it returns per-op totals only, with no timeline to
export. So a profiled OneFlow run writes no trace.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import oneflow as flow

from ..phases import compiled_step_phase, matmul_rate as timed_matmul_rate
from .dist import Dist
from .step import TrainStep

RANGE_PREFIX = "trainperf/"
NO_TRACE = ("OneFlow writes no trace (oneflow.profiler.profile aborts without a CUDA driver and "
            "has no timeline export); the phases are NVTX ranges for Nsight Systems")


GRAPH_METHOD = ("one nn.Graph job per step (--mode graph): data, then the job as one phase, each "
                "closed by OneFlow's virtual-machine sync (and CUDA synchronize on a GPU) and "
                "the host clock; oneflow.profiler.range_push ranges (NVTX), no trace")


def graph_merged_phases(world_size: int) -> dict[str, str]:
    """The phases a graph-mode step runs as one: the job OneFlow compiled from ``build``."""
    comm = ", the all-reduces its global tensors' SBP asks for" if world_size > 1 else ""
    return {compiled_step_phase(world_size):
            f"one nn.Graph job: the backbone's forward, the head, autograd's backward{comm}, "
            f"the clip and the SGD update are compiled together, and the host launches and "
            f"waits for the job as a whole"}


def method(dist: Dist, step: TrainStep) -> str:
    parts = ["OneFlow virtual-machine sync (and CUDA synchronize on a GPU) and the host clock "
             "between phases; oneflow.profiler.range_push ranges (NVTX), no trace"]
    if step.head is None:
        parts.append("classification: the head phase is the loss, its backward in backward")
    elif step.head_in_backward:
        parts.append("dp under DDP: the head's backward runs in backward")
    if step.ddp is not None:
        parts.append("gradient communication not hidden = backward less backward with DDP's "
                     "all-reduce skipped, alternate steps")
    elif step.data_parallel is not None:
        parts.append("float64: gradients averaged after the backward, in grad_comm")
    return "; ".join(parts)


@contextlib.contextmanager
def annotate(name: str) -> Iterator[None]:
    flow.profiler.range_push(RANGE_PREFIX + name)
    try:
        yield
    finally:
        flow.profiler.range_pop()


def profiler(trace_dir: str | None) -> contextlib.AbstractContextManager:
    if trace_dir:
        print(f"trainperf: --trace: {NO_TRACE}", file=sys.stderr, flush=True)
    return contextlib.nullcontext()


def matmul_rate(dist: Dist) -> tuple[float, str]:
    """FLOP/s of ``flow.matmul`` in float32 on the run's device (the only precision this
    backend runs)."""
    n = 8192 if dist.device_type == "cuda" else 1024
    a = flow.randn(n, n, device=dist.device)
    b = flow.randn(n, n, device=dist.device)
    rate = timed_matmul_rate(lambda: flow.matmul(a, b), 2.0 * n**3, dist.sync)
    return rate, f"oneflow.matmul float32 {n}^3"
