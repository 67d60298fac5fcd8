"""Entry point of one measured JAX run: ``python -m trainperf.backends.jax.worker --spec S
--events E``, started once per rank by ``trainperf.backends.spawn`` (``backend.py``).

It follows ``trainperf.protocol`` as the torch and MXNet workers do: rank 0 writes ``start``,
one ``step`` per step and ``end``; any rank that fails writes an ``error`` (kind ``oom`` or
``exception``) and exits non-zero (3 for an out-of-memory, 1 otherwise). For tests,
TRAINPERF_FAULT injects failures at steps (``trainperf.faults``).

Before JAX is imported the worker sets what must be set first: the platform
(``JAX_PLATFORMS``) from the spec's device, one intra-op thread when the spec asks for one
(``XLA_FLAGS``, appended to any flags the caller set; see ``SINGLE_THREAD_FLAG``), and the
coordinator of a multi-process run (``jax.distributed.initialize``).

Compilation: the step is lowered and compiled explicitly (``jit(...).lower(...).compile()``)
before the loop, and its seconds are reported in ``Start.settings["compile_s"]``, apart from the
measured window and from the warm-up steps (which still run, to warm allocators and
communicators). A persistent compilation cache, when the caller enables one through JAX's own
variables (``JAX_COMPILATION_CACHE_DIR``), turns later runs' compilations into cache loads (in
a multi-process run only process 0's: JAX 0.10 writes the cache from process 0 alone, and the
other processes' keys differ); the settings say whether one was configured.

Timing: ``trainperf.backends.loop`` (JAX dispatches a step and returns before it has run); a
step's marker is its loss, an output of the same executable as the updated weights (the state
itself cannot be: it is donated to the next step), waited on with ``jax.block_until_ready``,
which releases the GIL. Nothing is read back
inside the window: the losses (device arrays) are read after it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

from ..loop import MAX_STEPS_IN_FLIGHT, timed_loop
from ..workerkit import (gpu_names, limit_cpu_memory, memory_fields, rss_now_bytes, rss_peak_bytes,
                         worker_main, StepReporter)
from ...faults import inject, parse_faults
from ...protocol import End, EventWriter, RunSpec, Start

SINGLE_THREAD_FLAG = "--xla_cpu_multi_thread_eigen=false"
"""XLA's CPU client runs Eigen's kernels (convolutions) on a pool of one thread per core; this
keeps them on the calling thread (measured here: a convolution's CPU time per wall second drops
from about 1.4 to 0.6 on 2 cores). The ``intra_op_parallelism_threads=1`` often written beside
it is not an XLA flag (alone in XLA_FLAGS, XLA aborts on it), so it is not added. No XLA flag
sizes the pool to N threads that this worker knows of, so a spec asking for more than one
leaves XLA's default."""
PLATFORMS = {"cpu": "cpu", "cuda": "cuda"}


def configure_process(spec: RunSpec) -> None:
    """Settings JAX reads once, when its backends start: set before ``import jax``."""
    if spec.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {spec.device!r}; expected auto, cuda or cpu")
    if spec.device in PLATFORMS:
        os.environ["JAX_PLATFORMS"] = PLATFORMS[spec.device]
    if spec.threads == 1:
        flags = os.environ.get("XLA_FLAGS", "").split()
        if SINGLE_THREAD_FLAG not in flags:
            os.environ["XLA_FLAGS"] = " ".join([*flags, SINGLE_THREAD_FLAG])


# ---------------------------------------------------------------------------------- memory

def _device_stats(layout) -> dict:
    try:
        return layout.devices[layout.rank].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend keeps statistics
        return {}


def current_memory(layout) -> int:
    """Memory in use now: device memory in use on a GPU, or this process's resident set."""
    if layout.device_type == "cuda":
        return int(_device_stats(layout).get("bytes_in_use", 0))
    return rss_now_bytes()


def peak_memory(layout) -> tuple[int, int]:
    """(peak, reserved): the allocator's peak in use and its pool on a GPU; the process's
    peak resident set on CPU (both)."""
    if layout.device_type == "cuda":
        stats = _device_stats(layout)
        peak = int(stats.get("peak_bytes_in_use", 0))
        return peak, int(stats.get("pool_bytes", stats.get("bytes_reserved", peak)) or peak)
    rss = rss_peak_bytes()
    return rss, rss


def memory_over_ranks(layout) -> dict:
    """The largest figures over ranks, and every rank's peak (a collective call)."""
    per_rank = layout.gather_host(np.asarray(peak_memory(layout), dtype=np.int64))
    return memory_fields(per_rank.reshape(-1, 2), with_reserved=layout.device_type == "cuda")


# ----------------------------------------------------------------------------- environment

def _cuda_versions() -> tuple[Any, Any]:
    """(CUDA runtime, cuDNN) versions of the CUDA plug-in JAX loaded, when it has one."""
    try:
        from jax._src.lib import cuda_versions  # type: ignore[attr-defined]
    except ImportError:
        return None, None
    if cuda_versions is None:
        return None, None
    try:
        return cuda_versions.cuda_runtime_get_version(), cuda_versions.cudnn_get_version()
    except Exception:  # noqa: BLE001 - absent without a GPU
        return None, None


def framework_env(layout, threads: int | None) -> dict:
    import flax
    import jax
    import optax

    gpu = layout.device_type == "cuda"
    cuda, cudnn = _cuda_versions() if gpu else (None, None)
    return {
        "framework": "jax",
        "framework_version": jax.__version__,
        "jaxlib_version": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        "flax_version": flax.__version__,
        "optax_version": optax.__version__,
        "numpy_version": np.__version__,
        "device_type": layout.device_type,
        "device_names": (gpu_names() or [d.device_kind for d in layout.devices]) if gpu else [],
        "device_count": jax.device_count() if gpu else 0,
        "platform": layout.devices[0].platform,
        "cuda_version": cuda,
        "cudnn_version": cudnn,
        "nccl_version": None,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "threads": 1 if SINGLE_THREAD_FLAG in os.environ.get("XLA_FLAGS", "").split()
        else "xla default (one per core)",
        "threads_asked": threads,
        "default_matmul_precision": jax.config.jax_default_matmul_precision,
        "memory_measure": "allocator peak_bytes_in_use (device memory_stats)" if gpu
        else "peak resident set (ru_maxrss)",
    }


def _jaxlib_version() -> str | None:
    try:
        import jaxlib
        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


# ------------------------------------------------------------------------------------ run

def run(spec: RunSpec, events: EventWriter, layout) -> None:
    import jax

    from .step import TrainStep, init_batch, synthetic_batch

    workload, measure = spec.workload, spec.measure
    baseline = current_memory(layout)
    if layout.device_type == "cpu":
        limit_cpu_memory(measure.memory_limit_bytes)
    init = dict(np.load(spec.init)) if spec.init else None
    step = TrainStep(workload, layout, init=init)
    if init is not None:
        images, labels = layout.per_rank(lambda r: init_batch(workload, init, r))
    else:
        images, labels = layout.per_rank(lambda r: synthetic_batch(workload, r))
    global_batch = workload.batch_size * layout.world_size

    t0 = time.perf_counter()
    step.compile(images, labels)
    compile_s = time.perf_counter() - t0

    if layout.rank == 0:
        settings = {
            "compile_s": compile_s,
            "compile": "jax.jit(jax.shard_map(step)).lower(...).compile() before the loop; "
                       "state buffers donated to the next step",
            "compilation_cache_dir": jax.config.jax_compilation_cache_dir,
            "xla_cost_flops_per_step": step.cost_flops(),
            "precision": workload.precision,
            "rng": "rbg",
            "mesh": {"axis": "r", "devices": layout.world_size},
            "cudnn_benchmark": None,
            "ddp": None,
            "max_steps_in_flight": MAX_STEPS_IN_FLIGHT,
            "loss_scaling": "dynamic, one overflow decision for all ranks, on the device"
            if workload.precision == "fp16" else None,
        }
        events.emit(Start(
            world_size=layout.world_size, global_batch=global_batch, device=layout.device,
            env=framework_env(layout, spec.threads), workload=workload.to_dict(),
            settings=settings, backbone_params=step.param_count, pfc_update=step.pfc_update,
            baseline_memory_bytes=baseline))
    faults = parse_faults(layout.world_size)

    def one_step(index: int) -> Any:
        inject(faults, index, layout.rank,
               lambda msg: jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: {msg}"))
        return step(images, labels)

    on_steps = StepReporter(events, layout.rank, measure, global_batch)
    window_s, losses = timed_loop(one_step, lambda: step.markers, measure.iters,
                                  measure.warmup, on_steps, layout.barrier,
                                  jax.block_until_ready,
                                  lambda: jax.block_until_ready(step.state))
    on_steps.check_complete()
    # Read-backs after the window: this rank's losses, the skipped steps, the loss scale.
    loss_values = [float(layout.local_value(loss)[0]) for loss in losses]
    skipped, scale = step.skipped_steps(), step.loss_scale()
    memory = memory_over_ranks(layout)
    if layout.rank == 0:
        events.emit(End.of_window(window_s, measure, global_batch, loss_values, skipped,
                                  final_loss_scale=scale, baseline_memory_bytes=baseline,
                                  **memory))
    # No rank leaves (and shuts the coordinator down) while another still talks to it.
    layout.barrier("trainperf-end")


def main(argv: list[str] | None = None) -> int:
    started = False

    def run_spec(spec: RunSpec, events: EventWriter) -> None:
        nonlocal started
        configure_process(spec)
        from .dist import initialize_from_env, layout_from_env

        started = initialize_from_env()
        layout = layout_from_env(started)
        events.rank = layout.rank
        run(spec, events, layout)

    # After a failure, a normal exit would wait for the other ranks at JAX's shutdown barrier.
    return worker_main(argv, __doc__, run_spec, hard_exit=lambda: started)


if __name__ == "__main__":
    sys.exit(main())
