"""Entry point of one measured OneFlow run: ``python -m trainperf.backends.oneflow.worker --spec S
--events E``, started once per rank by ``trainperf.backends.spawn`` (``backend.py``).

It follows ``trainperf.protocol`` as the torch worker does: rank 0 writes ``start``, one ``step``
per step and ``end``; any rank that fails writes an ``error`` (kind ``oom`` or ``exception``) and
exits non-zero (3 for an out-of-memory, 1 otherwise). For tests, TRAINPERF_FAULT injects
failures at steps (``trainperf.faults``).

Timing: ``trainperf.backends.loop``. OneFlow's eager mode queues every operation on its virtual
machine and returns, so a step's markers (``TrainStep.markers``: one element of the last arrays
the step updates, copied after the update) are waited on by the loop's watcher thread with
``numpy()``, which releases the GIL while it blocks. The window's edges wait for the virtual
machine (``Dist.sync``). Losses stay on the device until the window has ended.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

from .rendezvous import wait_for_rank0

# Before OneFlow is imported: the import joins the process group (see rendezvous.py).
wait_for_rank0()

import numpy as np  # noqa: E402
import oneflow as flow  # noqa: E402

from ..loop import MAX_STEPS_IN_FLIGHT, timed_loop
from ..workerkit import (cudnn_version, gpu_names, limit_cpu_memory, memory_fields, rss_now_bytes,
                         rss_peak_bytes, worker_main, StepReporter)
from ...faults import inject, parse_faults
from ...protocol import End, EventWriter, RunSpec, Start
from . import models
from .dist import Dist, dist_from_env
from .step import TrainStep, init_batch, synthetic_batch


def wait_ready(arrays: Sequence[flow.Tensor]) -> None:
    for array in arrays:
        array.numpy()


# ---------------------------------------------------------------------------------- memory

def _gpu_process_bytes() -> int:
    """Device memory held by this process (nvidia-smi; OneFlow 0.9 exposes no allocator
    statistics). Its caching allocator keeps what it took, so after a run this is its peak."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(used.strip()) * 2**20
    return 0


def current_memory(dist: Dist) -> int:
    """Memory in use now: this process's device memory on a GPU, its resident set on CPU."""
    return _gpu_process_bytes() if dist.device_type == "cuda" else rss_now_bytes()


def peak_memory(dist: Dist) -> int:
    return _gpu_process_bytes() if dist.device_type == "cuda" else rss_peak_bytes()


def memory_over_ranks(dist: Dist) -> dict:
    """The largest peak over ranks, and every rank's (a collective call)."""
    per_rank = dist.gather_host([float(peak_memory(dist))])
    return memory_fields(per_rank, with_reserved=False)


# ---------------------------------------------------------------------------- environment

def _cudnn_version() -> int | None:
    """cudnnGetVersion() of the cuDNN the environment ships (the ``nvidia-cudnn`` wheel)."""
    site = os.path.dirname(os.path.dirname(flow.__file__))
    return cudnn_version(os.path.join(site, "nvidia", "cudnn", "lib", "libcudnn.so*"))


def framework_env(dist: Dist, threads: int | None) -> dict:
    gpu = dist.device_type == "cuda"
    env: dict = {
        "framework": "oneflow",
        "framework_version": flow.__version__,
        "numpy_version": np.__version__,
        "device_type": dist.device_type,
        "device_names": gpu_names() if gpu else [],
        "device_count": flow.cuda.device_count() if gpu else 0,
        "cuda_version": None,
        "cudnn_version": _cudnn_version() if gpu else None,
        "nccl_version": None,
        "intra_op_threads": threads,
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "memory_measure": ("device memory held by the process after the run (nvidia-smi)"
                           if gpu else "peak resident set (ru_maxrss)"),
    }
    if gpu:
        import oneflow.sysconfig
        code = int(oneflow.sysconfig.get_cuda_version())  # e.g. 11070
        env["cuda_version"] = f"{code // 1000}.{code % 1000 // 10}"
    return env


# ------------------------------------------------------------------------------------ run

def run(spec: RunSpec, events: EventWriter, dist: Dist) -> None:
    workload, measure = spec.workload, spec.measure
    baseline = current_memory(dist)
    if dist.device_type == "cpu":
        limit_cpu_memory(measure.memory_limit_bytes)
    init = None
    if spec.init:
        with np.load(spec.init) as f:
            init = {k: f[k] for k in f.files}
    step = TrainStep(workload, dist, spec.tuning, init=init)
    images, labels = (init_batch(workload, init, dist) if init is not None
                      else synthetic_batch(workload, dist))
    global_batch = workload.batch_size * dist.world_size
    if dist.rank == 0:
        settings = dict(step.settings)
        settings["cudnn_benchmark"] = None
        settings["max_steps_in_flight"] = MAX_STEPS_IN_FLIGHT
        events.emit(Start(
            world_size=dist.world_size, global_batch=global_batch, device=dist.device_name,
            env=framework_env(dist, spec.threads), workload=workload.to_dict(),
            settings=settings, backbone_params=models.param_count(step.backbone),
            pfc_update="full", baseline_memory_bytes=baseline))
    faults = parse_faults(dist.world_size)

    def one_step(index: int) -> flow.Tensor:
        inject(faults, index, dist.rank, lambda msg: MemoryError(msg))
        return step(images, labels)

    on_steps = StepReporter(events, dist.rank, measure, global_batch)
    window_s, losses = timed_loop(one_step, lambda: step.markers, measure.iters,
                                  measure.warmup, on_steps, dist.barrier, wait_ready, dist.sync)
    on_steps.check_complete()
    # Read-backs after the window.
    loss_values = [float(v) for v in flow.stack([l.reshape(()) for l in losses]).numpy()]
    memory = memory_over_ranks(dist)
    if dist.rank == 0:
        events.emit(End.of_window(window_s, measure, global_batch, loss_values,
                                  step.skipped_steps, final_loss_scale=step.loss_scale,
                                  baseline_memory_bytes=baseline, **memory))
    # No rank leaves while another still talks to it.
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    dist: Dist | None = None

    def run_spec(spec: RunSpec, events: EventWriter) -> None:
        nonlocal dist
        if spec.threads:
            # Before the first eager operation, as OneFlow asks.
            flow.set_num_threads(int(spec.threads))
        dist = dist_from_env(spec.device)
        events.rank = dist.rank
        run(spec, events, dist)

    # OneFlow's shutdown meets every other rank; after a failure they may never come.
    return worker_main(argv, __doc__, run_spec,
                       hard_exit=lambda: dist is not None and dist.distributed)


if __name__ == "__main__":
    sys.exit(main())
