"""Entry point of one measured MXNet run: ``python -m trainperf.backends.mxnet.worker --spec S
--events E``, started by ``launch.py`` (one process per rank, or one for all contexts).

It follows ``trainperf.protocol`` as the torch worker does: rank 0 writes ``start``, one ``step``
per step and ``end``; any rank that fails writes an ``error`` (kind ``oom`` or ``exception``) and
exits non-zero (3 for an out-of-memory, 1 otherwise). For tests, TRAINPERF_FAULT injects
failures at steps (``trainperf.faults``).

Timing: ``trainperf.backends.loop`` (MXNet runs every operation asynchronously on its engine);
a step's markers are small arrays that become ready when the step's last update has run
(``TrainStep.markers``), waited on with ``wait_to_read``, which releases the GIL.
"""

from __future__ import annotations

import ctypes
import os
import sys

import mxnet as mx
import numpy as np

from ..loop import MAX_STEPS_IN_FLIGHT, timed_loop
from ..workerkit import (cudnn_version, gpu_names, limit_cpu_memory, memory_fields, rss_now_bytes,
                         rss_peak_bytes, worker_main, StepReporter)
from ...faults import inject, parse_faults
from ...protocol import End, EventWriter, RunSpec, Start
from ...config import Tuning
from . import models
from .comm import Comm, comm_from_env
from .step import TrainStep, init_batch, synthetic_batch

def wait_ready(arrays) -> None:
    for array in arrays:
        array.wait_to_read()


# ---------------------------------------------------------------------------------- memory

def _gpu_used(ctx: mx.Context) -> int:
    free, total = mx.context.gpu_memory_info(ctx.device_id)
    return int(total - free)


def current_memory(comm: Comm) -> int:
    """Memory in use now: device memory in use on the first GPU, or this process's resident
    set on CPU."""
    if comm.device_type == "gpu":
        return _gpu_used(comm.contexts[0])
    return rss_now_bytes()


def limit_memory(limit_bytes: int | None, comm: Comm) -> None:
    """Cap this process's data segment on CPU (as the torch worker): a run that needs more
    fails with an allocation error instead of taking the machine down."""
    if comm.device_type == "cpu":
        limit_cpu_memory(limit_bytes)


def peak_memory(comm: Comm) -> list[tuple[int, int]]:
    """(peak, reserved) per context of this process. CPU: the process's peak resident set.
    GPU: MXNet 1.9 keeps no allocation peak; its pool holds on to freed blocks, so the device
    memory in use after the run (cudaMemGetInfo: the pool's high-water mark plus the CUDA
    context) is the figure for both."""
    if comm.device_type == "gpu":
        return [(_gpu_used(ctx), _gpu_used(ctx)) for ctx in comm.contexts]
    rss = rss_peak_bytes()
    return [(rss, rss)]


def memory_over_ranks(comm: Comm) -> dict:
    """The largest figures over ranks, and every rank's peak (a collective call)."""
    values = mx.nd.array(peak_memory(comm), ctx=mx.cpu(), dtype="float64")
    per_rank = comm.all_gather("worker/memory", values).asnumpy()
    return memory_fields(per_rank, with_reserved=comm.device_type == "gpu")


# ---------------------------------------------------------------------------- environment

def _cuda_version() -> str | None:
    """From the wheel's name (``mxnet-cu117`` -> ``11.7``)."""
    from importlib import metadata
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("mxnet-cu") and name[8:].isdigit():
            digits = name[8:]
            return f"{digits[:-1]}.{digits[-1]}"
    return None


def _cudnn_version() -> int | None:
    """cudnnGetVersion() of the cuDNN the wheel ships, when it ships one as a library."""
    libdir = os.path.dirname(mx.libinfo.find_lib_path()[0])
    return cudnn_version(os.path.join(libdir, "libcudnn*.so*"))


def framework_env(comm: Comm, threads: int | None) -> dict:
    gpu = comm.device_type == "gpu"
    env: dict = {
        "framework": "mxnet",
        "framework_version": mx.__version__,
        "numpy_version": np.__version__,
        "device_type": "cuda" if gpu else "cpu",
        "device_names": [],
        "device_count": mx.context.num_gpus() if gpu else 0,
        "cuda_version": None,
        "cudnn_version": None,
        "nccl_version": None,
        "kvstore": comm.mode,
        "omp_threads": threads or os.environ.get("OMP_NUM_THREADS"),
        "cpu_worker_threads": os.environ.get("MXNET_CPU_WORKER_NTHREADS", "1"),
        "cudnn_autotune": os.environ.get("MXNET_CUDNN_AUTOTUNE_DEFAULT") if gpu else None,
        "memory_measure": ("device memory in use after the run (MXNet keeps no allocation "
                           "peak; its pool keeps its high-water mark)") if gpu
        else "peak resident set (ru_maxrss)",
    }
    if gpu:
        env["device_names"] = gpu_names()
        env["cuda_version"] = _cuda_version()
        env["cudnn_version"] = _cudnn_version()
    return env


def configure(tuning: Tuning, threads: int | None) -> None:
    """Speed settings, before any network is built."""
    # 1: MXNet's default autotuning within its workspace limit; 0: none.
    os.environ["MXNET_CUDNN_AUTOTUNE_DEFAULT"] = "1" if tuning.cudnn_benchmark else "0"
    if threads:
        mx.base.check_call(mx.base._LIB.MXSetNumOMPThreads(ctypes.c_int(int(threads))))


# ------------------------------------------------------------------------------------ run

def run(spec: RunSpec, events: EventWriter, comm: Comm) -> None:
    workload, measure = spec.workload, spec.measure
    baseline = current_memory(comm)
    limit_memory(measure.memory_limit_bytes, comm)
    configure(spec.tuning, spec.threads)
    init = np.load(spec.init) if spec.init else None
    step = TrainStep(workload, comm, spec.tuning, init=init)
    batches = [init_batch(workload, init, rank, ctx) if init is not None
               else synthetic_batch(workload, rank, ctx)
               for ctx, rank in zip(comm.contexts, comm.ranks)]
    global_batch = workload.batch_size * comm.world_size
    if comm.rank == 0:
        settings = dict(step.settings)
        settings["cudnn_benchmark"] = spec.tuning.cudnn_benchmark \
            if comm.device_type == "gpu" else None
        settings["ddp"] = None
        settings["max_steps_in_flight"] = MAX_STEPS_IN_FLIGHT
        events.emit(Start(
            world_size=comm.world_size, global_batch=global_batch, device=comm.device,
            env=framework_env(comm, spec.threads), workload=workload.to_dict(),
            settings=settings, backbone_params=models.param_count(step.net),
            pfc_update="full" if workload.task == "face" else None,
            baseline_memory_bytes=baseline))
    faults = parse_faults(comm.world_size)

    def one_step(index: int) -> mx.nd.NDArray:
        inject(faults, index, comm.rank, lambda msg: mx.base.MXNetError(msg))
        return step(batches)

    on_steps = StepReporter(events, comm.rank, measure, global_batch)
    window_s, losses = timed_loop(one_step, lambda: step.markers, measure.iters,
                                  measure.warmup, on_steps, comm.barrier, wait_ready,
                                  mx.nd.waitall)
    on_steps.check_complete()
    # Read-backs after the window.
    loss_values = [float(v) for v in
                   mx.nd.concat(*[l.reshape((1,)).as_in_context(mx.cpu()) for l in losses],
                                dim=0).asnumpy()]
    memory = memory_over_ranks(comm)
    if comm.rank == 0:
        events.emit(End.of_window(window_s, measure, global_batch, loss_values,
                                  step.skipped_steps, final_loss_scale=step.loss_scale,
                                  baseline_memory_bytes=baseline, **memory))
    # No rank tears the kvstore down while another still talks to it.
    comm.barrier()


def main(argv: list[str] | None = None) -> int:
    comm: Comm | None = None

    def run_spec(spec: RunSpec, events: EventWriter) -> None:
        nonlocal comm
        comm = comm_from_env(spec.device)
        events.rank = comm.rank
        run(spec, events, comm)

    # Leaving normally would finalize the kvstore, which waits for every other rank.
    return worker_main(argv, __doc__, run_spec,
                       hard_exit=lambda: comm is not None and comm.distributed)


if __name__ == "__main__":
    sys.exit(main())
