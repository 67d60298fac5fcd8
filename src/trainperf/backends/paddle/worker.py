"""Entry point of one measured Paddle run: ``python -m trainperf.backends.paddle.worker --spec S
--events E``, one process per rank, started by ``trainperf.backends.spawn`` with the variables
of ``backend.rank_env`` (Paddle's own launcher's names).

It follows ``trainperf.protocol`` as the torch worker does: rank 0 writes ``start``, one ``step``
per step and ``end``; any rank that fails writes an ``error`` (kind ``oom`` or ``exception``) and
exits non-zero (3 for an out-of-memory, 1 otherwise). For tests, TRAINPERF_FAULT injects
failures at steps (``trainperf.faults``).

Timing: ``trainperf.backends.loop``. On a CPU Paddle's dynamic graph runs every operation to
the end before the call returns, so a step's markers are empty and the watcher's stamp after
each call is the step's time. On a GPU kernels are queued on the device's stream: each step
records a ``paddle.device.Event`` on that stream after its last update, and the watcher waits
for it by polling ``Event.query()`` between short sleeps (a sleep releases the GIL, so the main
thread queues the next step meanwhile, whether or not ``Event.synchronize()`` would have); the
window's edges wait with ``paddle.device.synchronize()``.

A finished worker leaves with ``os._exit`` once its events are written: Paddle's interpreter
teardown costs about a second per process and decides nothing.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np
import paddle

from ..loop import MAX_STEPS_IN_FLIGHT, timed_loop
from ..workerkit import (gpu_names, leave, limit_cpu_memory, memory_fields, rss_now_bytes,
                         rss_peak_bytes, worker_main, StepReporter)
from ...faults import inject, parse_faults
from ...protocol import End, EventWriter, RunSpec, Start
from . import models
from .backend import CUDNN_SEARCH_FLAG
from .comm import Comm, comm_from_env
from .step import TrainStep, init_batch, synthetic_batch

EVENT_POLL_S = 5e-5


def wait_events(markers: Sequence) -> None:
    for event in markers:
        while not event.query():
            time.sleep(EVENT_POLL_S)


def step_markers(comm: Comm) -> list:
    """What the watcher waits on for the step just issued: nothing on a CPU (the step has run),
    an event recorded on the current stream on a GPU."""
    if comm.device_type != "gpu":
        return []
    event = paddle.device.Event()
    event.record()
    return [event]


def sync(comm: Comm) -> None:
    if comm.device_type == "gpu":
        paddle.device.synchronize()


# ---------------------------------------------------------------------------------- memory

def current_memory(comm: Comm) -> int:
    """Memory in use now: allocated device memory on a GPU, this process's resident set on CPU."""
    if comm.device_type == "gpu":
        return int(paddle.device.cuda.memory_allocated(comm.gpu_index))
    return rss_now_bytes()


def peak_memory(comm: Comm) -> tuple[int, int]:
    """(peak, reserved): Paddle's allocator peaks on a GPU, the peak resident set on CPU."""
    if comm.device_type == "gpu":
        return (int(paddle.device.cuda.max_memory_allocated(comm.gpu_index)),
                int(paddle.device.cuda.max_memory_reserved(comm.gpu_index)))
    rss = rss_peak_bytes()
    return rss, rss


def memory_over_ranks(comm: Comm) -> dict:
    """The largest figures over ranks, and every rank's peak (a collective call)."""
    mine = paddle.to_tensor(np.array([peak_memory(comm)], dtype=np.float64))
    per_rank = comm.all_gather(mine).numpy()
    return memory_fields(per_rank, with_reserved=comm.device_type == "gpu")


# ---------------------------------------------------------------------------- environment

def framework_env(comm: Comm, threads: int | None) -> dict:
    gpu = comm.device_type == "gpu"
    env: dict = {
        "framework": "paddle",
        "framework_version": paddle.__version__,
        "numpy_version": np.__version__,
        "device_type": "cuda" if gpu else "cpu",
        "device_names": [],
        "device_count": 0,
        "cuda_version": None,
        "cudnn_version": None,
        "nccl_version": None,
        "paddle_commit": getattr(paddle.version, "commit", None),
        "collective_backend": comm.backend,
        "omp_threads": threads or os.environ.get("OMP_NUM_THREADS"),
        "memory_measure": "paddle.device.cuda.max_memory_allocated" if gpu
        else "peak resident set (ru_maxrss)",
    }
    if gpu:
        env["device_count"] = paddle.device.cuda.device_count()
        env["device_names"] = gpu_names()
        env["cuda_version"] = paddle.version.cuda()
        env["cudnn_version"] = paddle.version.cudnn()
        nccl = getattr(paddle.version, "nccl", None)
        env["nccl_version"] = nccl() if callable(nccl) else None
    return env


def configure(threads: int | None) -> None:
    """Intra-op threads on CPU (the runner sets OMP_NUM_THREADS too, before Paddle starts)."""
    if threads:
        paddle.base.core.set_num_threads(int(threads))


# ------------------------------------------------------------------------------------ run

def run(spec: RunSpec, events: EventWriter, comm: Comm) -> None:
    workload, measure = spec.workload, spec.measure
    baseline = current_memory(comm)
    if comm.device_type == "cpu":
        limit_cpu_memory(measure.memory_limit_bytes)
    configure(spec.threads)
    init = dict(np.load(spec.init)) if spec.init else None
    step = TrainStep(workload, comm, spec.tuning, init=init)
    images, labels = (init_batch(workload, init, comm.rank) if init is not None
                      else synthetic_batch(workload, comm.rank))
    global_batch = workload.batch_size * comm.world_size
    if comm.rank == 0:
        settings = dict(step.settings)
        settings["cudnn_benchmark"] = (os.environ.get(CUDNN_SEARCH_FLAG) == "1"
                                       if comm.device_type == "gpu" else None)
        settings["ddp"] = None
        settings["max_steps_in_flight"] = MAX_STEPS_IN_FLIGHT
        events.emit(Start(
            world_size=comm.world_size, global_batch=global_batch, device=comm.device,
            env=framework_env(comm, spec.threads), workload=workload.to_dict(),
            settings=settings, backbone_params=models.param_count(step.net),
            pfc_update=step.pfc_update, baseline_memory_bytes=baseline))
    faults = parse_faults(comm.world_size)

    def one_step(index: int) -> paddle.Tensor:
        inject(faults, index, comm.rank, MemoryError)
        return step(images, labels)

    on_steps = StepReporter(events, comm.rank, measure, global_batch)
    window_s, losses = timed_loop(one_step, lambda: step_markers(comm), measure.iters,
                                  measure.warmup, on_steps, comm.barrier, wait_events,
                                  lambda: sync(comm))
    on_steps.check_complete()
    # Read-backs after the window.
    loss_values = [float(v) for v in paddle.stack(losses).astype("float32").numpy()]
    memory = memory_over_ranks(comm)
    if comm.rank == 0:
        events.emit(End.of_window(window_s, measure, global_batch, loss_values,
                                  step.skipped_steps, final_loss_scale=step.loss_scale,
                                  baseline_memory_bytes=baseline, **memory))
    # No rank tears its process group down while another still talks to it.
    comm.barrier()


def main(argv: list[str] | None = None) -> int:
    comm: Comm | None = None

    def run_spec(spec: RunSpec, events: EventWriter) -> None:
        nonlocal comm
        comm = comm_from_env(spec.device)
        events.rank = comm.rank
        run(spec, events, comm)

    # A failed rank leaves at once: Paddle's exit would wait on peers stuck in a collective.
    return worker_main(argv, __doc__, run_spec,
                       hard_exit=lambda: comm is not None and comm.distributed)


if __name__ == "__main__":
    # Paddle's interpreter teardown (its C++ destructors) takes about a second per process.
    leave(main())
