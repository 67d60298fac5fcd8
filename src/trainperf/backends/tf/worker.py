"""Entry point of one measured TensorFlow run: ``python -m trainperf.backends.tf.worker --spec S
--events E``, one process per rank started by ``trainperf.backends.spawn`` with ``TF_CONFIG``
(``backend.rank_env``).

It follows ``trainperf.protocol`` as the torch worker does: rank 0 writes ``start``, one ``step``
per step and ``end``; any rank that fails writes an ``error`` (kind ``oom`` or ``exception``) and
exits non-zero (3 for an out-of-memory, 1 otherwise). For tests, TRAINPERF_FAULT injects
failures at steps (``trainperf.faults``).

Timing: ``trainperf.backends.loop``. A call of the step's ``tf.function`` may return before its
work is done on a GPU, so a step's markers are its output tensors (the loss and the step counter
read after the last update) and the watcher thread waits on them by reading them back
(``.numpy()`` of two scalars): TensorFlow has no public wait that copies nothing, and these
few bytes, read by the watcher and never by the loop, are the one read-back in the window. The
window's edges wait for all device work with ``tf.test.experimental.sync_devices`` in one
process, and on the last step's markers with several (where ``sync_devices`` would reach for the
other workers' devices).

Compilation: the first call traces the Python step into a graph and optimises it; it is step 0,
inside the warm-up. Its host seconds go into ``Start.settings["compile_s"]``, so ``start`` is
written when step 0 is done, just before step 0's own event (or, if the run fails before, with
``compile_s`` None).
"""

from __future__ import annotations

import os
import time

import numpy as np
import tensorflow as tf

from ..loop import MAX_STEPS_IN_FLIGHT, timed_loop
from ..workerkit import (gpu_names, leave, limit_cpu_memory, memory_fields, rss_now_bytes,
                         rss_peak_bytes, worker_main, StepReporter)
from ...faults import inject, parse_faults
from ...protocol import End, EventWriter, RunSpec, Start
from . import models
from .comm import Comm
from .step import TrainStep, init_batch, synthetic_batch


def wait_ready(arrays) -> None:
    for array in arrays:
        array.numpy()



# ---------------------------------------------------------------------------------- memory

def current_memory(comm: Comm) -> int:
    """Allocated device memory on a GPU, this process's resident set on CPU."""
    if comm.device_type == "gpu":
        return int(tf.config.experimental.get_memory_info("GPU:0")["current"])
    return rss_now_bytes()


def peak_memory(comm: Comm) -> int:
    """The allocator's peak of allocated bytes on a GPU; the peak resident set on CPU."""
    if comm.device_type == "gpu":
        return int(tf.config.experimental.get_memory_info("GPU:0")["peak"])
    return rss_peak_bytes()


def memory_over_ranks(comm: Comm) -> dict:
    """The largest peak over ranks, and every rank's (a collective call)."""
    per_rank = comm.gather_rows(np.array([peak_memory(comm)], dtype=np.float64))
    return memory_fields(per_rank.reshape(-1, 1), with_reserved=False)


# ---------------------------------------------------------------------------- environment

def _version_of(package: str) -> str | None:
    """An installed package's version without importing it (Keras is not used here)."""
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def onednn_opts() -> bool | None:
    """Whether TensorFlow runs its oneDNN custom CPU ops in this process, as TensorFlow itself
    decided from ``TF_ENABLE_ONEDNN_OPTS`` and the CPU (None where it cannot be asked)."""
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return None
    return bool(_pywrap_util_port.IsMklEnabled())


def framework_env(comm: Comm, threads: int | None) -> dict:
    gpu = comm.device_type == "gpu"
    build = tf.sysconfig.get_build_info()
    env: dict = {
        "framework": "tensorflow",
        "framework_version": tf.__version__,
        "keras_version": _version_of("keras"),
        "numpy_version": np.__version__,
        "device_type": "cuda" if gpu else "cpu",
        "device_names": gpu_names() if gpu else [],
        "device_count": len(tf.config.list_physical_devices("GPU")) if gpu else 0,
        "cuda_version": build.get("cuda_version") if gpu else None,
        "cudnn_version": build.get("cudnn_version") if gpu else None,
        "nccl_version": None,
        "collective": comm.communication,
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads() or None,
        "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads() or None,
        "threads_asked": threads,
        "tf32": tf.config.experimental.tensor_float_32_execution_enabled() if gpu else None,
        "cudnn_autotune": os.environ.get("TF_CUDNN_USE_AUTOTUNE", "1") if gpu else None,
        "memory_measure": "allocator peak (tf.config.experimental.get_memory_info)" if gpu
        else "peak resident set (ru_maxrss)",
    }
    return env


# ------------------------------------------------------------------------------------ run

def run(spec: RunSpec, events: EventWriter, comm: Comm) -> None:
    workload, measure = spec.workload, spec.measure
    baseline = current_memory(comm)
    if comm.device_type == "cpu":
        limit_cpu_memory(measure.memory_limit_bytes)
    init = np.load(spec.init) if spec.init else None
    step = TrainStep(workload, comm, init=init)
    images, labels = (init_batch(workload, init, comm.rank, comm.tf_device) if init is not None
                      else synthetic_batch(workload, comm.rank, comm.tf_device))
    global_batch = workload.batch_size * comm.world_size
    faults = parse_faults(comm.world_size)
    compile_s: list[float] = []
    started = False

    def write_start() -> None:
        nonlocal started
        started = True
        if comm.rank != 0:
            return
        settings = dict(step.settings)
        settings.update({
            "compile_s": compile_s[0] if compile_s else None,
            "cudnn_benchmark": spec.tuning.cudnn_benchmark if comm.device_type == "gpu" else None,
            "ddp": None, "max_steps_in_flight": MAX_STEPS_IN_FLIGHT,
            "onednn_opts": onednn_opts()})
        events.emit(Start(
            world_size=comm.world_size, global_batch=global_batch, device=comm.device,
            env=framework_env(comm, spec.threads), workload=workload.to_dict(),
            settings=settings, backbone_params=models.param_count(step.backbone),
            pfc_update="full" if workload.task == "face" else None,
            baseline_memory_bytes=baseline))

    outputs: list[tuple] = []

    def one_step(index: int):
        inject(faults, index, comm.rank,
               lambda msg: tf.errors.ResourceExhaustedError(None, None, msg))
        t0 = time.perf_counter()
        out = step(images, labels)
        if index == 0:
            compile_s.append(time.perf_counter() - t0)
        outputs.append(out)
        return out

    def start_once() -> None:
        if not started:
            write_start()

    on_steps = StepReporter(events, comm.rank, measure, global_batch, first=start_once)

    def sync() -> None:
        if not comm.distributed:
            tf.test.experimental.sync_devices()
        elif outputs:
            # sync_devices would also sync the other workers' devices, which a multi-worker
            # eager context refuses; the last step's markers depend on all of its work.
            wait_ready(outputs[-1][:2])

    try:
        window_s, _ = timed_loop(one_step, lambda: outputs[-1][:2], measure.iters,
                                 measure.warmup, on_steps, comm.barrier, wait_ready, sync)
    except BaseException:
        start_once()
        raise
    on_steps.check_complete()
    # Read-backs after the window.
    losses = [float(v) for v in tf.stack([o[0] for o in outputs]).numpy()]
    skipped = [i for i, o in enumerate(outputs) if bool(o[2].numpy())]
    memory = memory_over_ranks(comm)
    if comm.rank == 0:
        scale = float(step.loss_scale.numpy()) if step.fp16 else None
        events.emit(End.of_window(window_s, measure, global_batch, losses, skipped,
                                  final_loss_scale=scale, baseline_memory_bytes=baseline,
                                  **memory))
    # No rank leaves while another still needs it for a collective.
    comm.barrier()


def main(argv: list[str] | None = None) -> int:
    comm: Comm | None = None

    def run_spec(spec: RunSpec, events: EventWriter) -> None:
        nonlocal comm
        # Read once, at the first convolution: cuDNN's timing of its algorithms per shape.
        os.environ["TF_CUDNN_USE_AUTOTUNE"] = "1" if spec.tuning.cudnn_benchmark else "0"
        comm = Comm.create(spec.device, spec.threads)
        events.rank = comm.rank
        run(spec, events, comm)

    # A failing rank leaves at once: TensorFlow's shutdown would wait on peers stuck in a
    # collective; the launcher stops them.
    return worker_main(argv, __doc__, run_spec,
                       hard_exit=lambda: comm is not None and comm.distributed)


if __name__ == "__main__":
    # TensorFlow's interpreter teardown takes seconds.
    leave(main())
