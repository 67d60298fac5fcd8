"""Entry point of one measured JAX run: ``python -m trainperf.backends.jax.worker --spec S
--events E``, started once per rank by ``trainperf.backends.spawn`` (``backend.py``).

The entry, failures, injected faults (``TRAINPERF_FAULT``) and the ``start``/``step``/``end``
events are ``workerkit``'s, as for every framework; this module is JAX's side of a run.

Before JAX is imported the worker sets what must be set first: the platform
(``JAX_PLATFORMS``) from the spec's device, the rank's share of the cores (``spec.threads``, the
runner's cores per rank: XLA's CPU thread pools sized by ``PJRT_NPROC``, and with one thread
Eigen's kernels kept on the calling thread, ``XLA_FLAGS`` appended to any flags the caller set;
see ``POOL_SIZE_VAR`` and ``SINGLE_THREAD_FLAG``), and the coordinator of a multi-process run
(``jax.distributed.initialize``). What the rank runs with, read back in the process (the pool's
threads counted by name, the cores it may run on), is in the start event's ``env``
(``thread_settings``).

Compilation: the step is lowered and compiled explicitly (``jit(...).lower(...).compile()``)
before the loop, apart from the measured window and from the warm-up steps (which still run,
to warm allocators and communicators). Its seconds, timed around the lowering and XLA's compile
(``TrainStep.compile``), are the run's compile time (``End.compile_s``), and it is the run's one
compilation (``compile_count``): the ``Compiled`` object it makes never traces again. A
persistent compilation cache, when the caller enables one through JAX's own variables
(``JAX_COMPILATION_CACHE_DIR``), turns later runs' compilations into cache loads (in a
multi-process run only process 0's: JAX 0.10 writes the cache from process 0 alone, and the
other processes' keys differ); the settings and ``compile_measure`` say whether one was
configured.

Speed settings (``tuning.py``): on a GPU, TF32 is JAX's ``jax_default_matmul_precision``, set
once the device is known and before the step is traced; cuDNN's timing off compiles the step
with XLA's autotuning off. Memory on a GPU is the allocator's ``peak_bytes_in_use``, with the
device's used memory beside it (``workerkit.device_used_bytes``).

Alignment (``RunSpec.align``): the start file's weights and batches instead of drawn ones; in
float64, JAX's 64-bit mode is switched on before any array exists (``configure_process``) and
the whole step runs in float64 (``step.py``); with a dump, ``align_state`` gives each step's
state in torch's names (``alignment.py``). A throughput run sets none of it.

Timing: ``trainperf.backends.loop`` (JAX dispatches a step and returns before it has run); a
step's marker is its loss, an output of the same executable as the updated weights (the state
itself cannot be: it is donated to the next step), waited on with ``jax.block_until_ready``,
which releases the GIL. Nothing is read back
inside the window: the losses (device arrays) are read after it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from ...protocol import RunSpec
from ..phases import PhaseClock, compiled_step_phase
from ..workerkit import (FrameworkRun, RealData, StepState, align_dtype, breaks_margin,
                         device_used_bytes, dumps_state, environment, load_init, memory_fields,
                         rss_now_bytes, leave, rss_peak_bytes, worker_entry)
from . import tuning
from .backend import BACKEND

SINGLE_THREAD_FLAG = "--xla_cpu_multi_thread_eigen=false"
"""XLA's CPU client runs Eigen's kernels (convolutions) on its intra-op pool; this keeps them on
the calling thread (measured here: a convolution's CPU time per wall second drops from about 1.4
to 0.6 on 2 cores), added when a rank's share is one thread. The
``intra_op_parallelism_threads=1`` often written beside it is not an XLA flag (alone in
XLA_FLAGS, XLA aborts on it), so it is not added: ``POOL_SIZE_VAR`` sizes the pool."""
POOL_SIZE_VAR = "PJRT_NPROC"
"""XLA's own knob for its CPU client's threads: the intra-op pool (``POOL_THREAD_NAME``: Eigen's
kernels, the thunk executor's parallel work) and the client's pool take this many threads, read
once when the client starts; without it, one per core the process may run on, so each of N
ranks on one machine would start a pool over all the cores. Set to ``spec.threads`` over any
value the caller's environment had (the runner gives every rank its share)."""
POOL_THREAD_NAME = "tf_XLAEigen"
"""The name XLA gives its intra-op pool's threads (``/proc/self/task/*/comm``)."""
PLATFORMS = {"cpu": "cpu", "cuda": "cuda"}


def configure_process(spec: RunSpec) -> None:
    """Settings JAX reads once, when its backends start: set before ``import jax``."""
    if spec.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {spec.device!r}; expected auto, cuda or cpu")
    if spec.device in PLATFORMS:
        os.environ["JAX_PLATFORMS"] = PLATFORMS[spec.device]
    if spec.threads:
        os.environ[POOL_SIZE_VAR] = str(spec.threads)
    if spec.threads == 1:
        flags = os.environ.get("XLA_FLAGS", "").split()
        if SINGLE_THREAD_FLAG not in flags:
            os.environ["XLA_FLAGS"] = " ".join([*flags, SINGLE_THREAD_FLAG])
    if align_dtype(spec) == "float64":
        # Read when JAX starts: without it every float64 array would silently be float32.
        os.environ["JAX_ENABLE_X64"] = "1"


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


def peak_memory(layout) -> tuple[int, ...]:
    """(peak, reserved, device used) on a GPU: the allocator's peak in use and its pool, and the
    device-wide used memory (-1 where the driver cannot say); (peak, peak) of the process's
    resident set on a CPU."""
    if layout.device_type == "cuda":
        stats = _device_stats(layout)
        peak = int(stats.get("peak_bytes_in_use", 0))
        used = device_used_bytes(layout.devices[layout.rank].local_hardware_id)
        return (peak, int(stats.get("pool_bytes", stats.get("bytes_reserved", peak)) or peak),
                -1 if used is None else used)
    rss = rss_peak_bytes()
    return rss, rss


def memory_over_ranks(layout) -> dict:
    """The largest figures over ranks, and every rank's peak (a collective call)."""
    row = np.asarray(peak_memory(layout), dtype=np.int64)
    per_rank = layout.gather_host(row).reshape(-1, len(row))
    gpu = layout.device_type == "cuda"
    return memory_fields(per_rank, with_reserved=gpu, with_device_used=gpu)


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
    env = environment(
        "jax", jax.__version__, gpu, "allocator peak_bytes_in_use (device memory_stats)",
        memory_kind="allocator_peak", **tuning.tf32_fields(gpu),
        jaxlib_version=getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        flax_version=flax.__version__, optax_version=optax.__version__,
        device_count=jax.device_count() if gpu else 0, platform=layout.devices[0].platform,
        cuda_version=cuda, cudnn_version=cudnn, xla_flags=os.environ.get("XLA_FLAGS", ""),
        **thread_settings(threads),
        cpu_collectives=jax.config.jax_cpu_collectives_implementation
        if layout.distributed and not gpu else None,
        default_matmul_precision=jax.config.jax_default_matmul_precision)
    if gpu and not env["device_names"]:
        env["device_names"] = [d.device_kind for d in layout.devices]
    return env


def pool_threads() -> int | None:
    """How many threads XLA's intra-op pool has in this process (counted by their name), or
    None where the process's threads cannot be listed."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as f:
                count += f.read().strip() == POOL_THREAD_NAME
        except OSError:  # the thread ended while the list was read
            continue
    return count


def thread_settings(threads: int | None) -> dict:
    """The rank's share of the cores as it runs (after JAX's CPU client started): the threads
    asked, XLA's pool size variable, the pool's threads counted, where Eigen's kernels run, the
    cores the process may run on and OpenMP's variable (XLA's CPU kernels use no OpenMP; a
    library loaded beside it might)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on every platform
        cores = None
    size = os.environ.get(POOL_SIZE_VAR)
    return {"threads": int(size) if size and size.isdigit() else
            f"xla default (one per core: {len(cores) if cores else os.cpu_count()})",
            "threads_asked": threads,
            "pjrt_nproc": size,
            "xla_pool_threads": pool_threads(),
            "eigen_kernels": "calling thread" if SINGLE_THREAD_FLAG in flags
            else "intra-op pool",
            "cpu_affinity": cores,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def threads_over_ranks(layout) -> list[dict]:
    """Every rank's share as it runs (a collective call: every rank, before the start event,
    which rank 0 alone writes): XLA's pool size variable (None: unset), the pool's threads
    counted (None: not countable), whether Eigen's kernels stay on the calling thread, and how
    many cores the process may run on."""
    own = thread_settings(None)
    size = own["pjrt_nproc"]
    row = [int(size) if size and size.isdigit() else -1,
           -1 if own["xla_pool_threads"] is None else own["xla_pool_threads"],
           int(own["eigen_kernels"] == "calling thread"),
           len(own["cpu_affinity"]) if own["cpu_affinity"] else -1]
    rows = layout.gather_host(np.asarray(row, np.int64)).reshape(-1, len(row))
    return [{"pjrt_nproc": None if r[0] < 0 else int(r[0]),
             "xla_pool_threads": None if r[1] < 0 else int(r[1]),
             "eigen_kernels": "calling thread" if r[2] else "intra-op pool",
             "cpu_cores": None if r[3] < 0 else int(r[3])} for r in rows.tolist()]


def _jaxlib_version() -> str | None:
    try:
        import jaxlib
        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


# ------------------------------------------------------------------------------------ run

class JaxRun(FrameworkRun):
    backend = BACKEND
    compiler_options: dict[str, Any] | None = None
    """XLA's compile options of the step (``tuning.compiler_options``), set by ``build``."""

    def connect(self) -> None:
        configure_process(self.spec)
        from .dist import check_sees_gpu, initialize_from_env, layout_from_env

        # After a failure, a normal exit would wait for the other ranks at JAX's shutdown
        # barrier.
        self.distributed = initialize_from_env()
        if self.spec.device == "cuda":
            check_sees_gpu()
        self.layout = layout = layout_from_env(self.distributed)
        self.rank, self.world_size = layout.rank, layout.world_size
        self.device, self.device_kind = layout.device, layout.device_type
        # Before build traces the step: the precision is part of what is traced.
        tuning.configure(self.spec.tuning, self.gpu)

    @property
    def gpu(self) -> bool:
        return self.device_kind == "cuda"

    def close(self) -> None:
        """After a run that went to its end (a failed distributed rank leaves at once): leave
        the coordination service through its shutdown barrier, as ``jax.distributed``'s exit
        hook would, so that no process sees the coordinator go while it still polls it."""
        if self.distributed:
            import jax

            jax.distributed.shutdown()

    def memory_now(self) -> int:
        return current_memory(self.layout)

    def build(self) -> None:
        from .step import TrainStep, init_batch, synthetic_batch

        spec, layout = self.spec, self.layout
        workload, align, dtype = spec.workload, spec.align, align_dtype(spec)
        init = load_init(spec)
        self.train_step = TrainStep(
            workload, layout, init=init, dtype=dtype, record=dumps_state(align),
            straight_through=breaks_margin(align))
        if init is not None:
            self.images, self.labels = layout.per_rank(
                lambda r: init_batch(workload, init, r, dtype))
        else:
            self.images, self.labels = layout.per_rank(lambda r: synthetic_batch(workload, r))
        self.rank_threads = threads_over_ranks(layout)
        self.compiler_options = tuning.compiler_options(spec.tuning, self.gpu)
        self.train_step.compile(self.images, self.labels, self.compiler_options)
        if spec.data is not None:
            # Compiled for the synthetic batch's shapes and dtypes, which real batches share.
            self.real = RealData(spec, layout.local_ranks, layout.world_size, self.real_batch)

    def real_batch(self, images: np.ndarray, labels: np.ndarray, position: int) -> Any:
        """A real batch on this process's ``position``-th device: the uint8 NHWC images copied
        over, then float32 and normalised there (NHWC, as the step takes them)."""
        import jax
        import jax.numpy as jnp

        device = self.layout.devices[self.layout.local_ranks[position]]
        mean, std = self.real.constants(position, lambda *ms: [
            jax.device_put(np.asarray(v, np.float32), device) for v in ms])
        x = jax.device_put(images, device).astype(jnp.float32)
        return (x - mean) / std, jax.device_put(labels.astype(np.int32), device)

    def start_fields(self, baseline: int) -> dict:
        import jax

        step, workload = self.train_step, self.spec.workload
        settings = {
            "compile": "jax.jit(jax.shard_map(step)).lower(...).compile() before the loop; "
                       "state buffers donated to the next step",
            "compilation_cache_dir": jax.config.jax_compilation_cache_dir,
            "xla_cost_flops_per_step": step.cost_flops(),
            "precision": workload.precision,
            "rng": "rbg",
            "mesh": {"axis": "r", "devices": self.world_size},
            "grad_reduce": step.grad_reduce,
            "gloo_send_buffer_bytes": self.layout.gloo_send_bytes,
            "compiler_options": self.compiler_options,
            "cudnn_benchmark": self.applied_tuning().get("cudnn_benchmark"),
            "ddp": None,
            "loss_scaling": "dynamic, one overflow decision for all ranks, on the device"
            if workload.precision == "fp16" else None,
        }
        env = {**framework_env(self.layout, self.spec.threads),
               "threads_per_rank": self.rank_threads}
        return {"env": env, "settings": settings,
                "backbone_params": step.param_count, "pfc_update": step.pfc_update}

    def applied_tuning(self) -> dict[str, Any]:
        return tuning.applied(self.gpu, self.compiler_options)

    def batch(self) -> tuple[Any, Any]:
        """This step's (images, labels), global arrays over the ranks."""
        if self.real is None:
            return self.images, self.labels
        batches = dict(zip(self.layout.local_ranks, self.real.next()))
        return self.layout.per_rank(batches.__getitem__)

    def step(self, index: int) -> Any:
        return self.train_step(*self.batch())

    def compile_count(self) -> int | None:
        return self.train_step.compiles

    def compile_seconds(self) -> float | None:
        return self.train_step.compile_s

    def compile_measure(self) -> str | None:
        import jax

        text = ("jax.jit(jax.shard_map(step)).lower(...) (tracing to StableHLO) and .compile() "
                "(XLA), once before the loop; the compiled executable never retraces")
        if jax.config.jax_compilation_cache_dir:
            text += "; a persistent compilation cache is configured: .compile() may load it"
        return text

    def wait(self, markers) -> None:
        import jax

        jax.block_until_ready(markers)

    def sync(self) -> None:
        import jax

        jax.block_until_ready(self.train_step.state)

    def barrier(self) -> None:
        self.layout.barrier()

    def oom_error(self, message: str) -> BaseException:
        import jax

        return jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: {message}")

    def read_losses(self, outputs: list) -> list[float]:
        """This rank's losses (device arrays until now)."""
        return [float(self.layout.local_value(loss)[0]) for loss in outputs]

    # -- profiled runs (``profiling.py``) -------------------------------------------------------
    @property
    def phase_method(self) -> str:  # type: ignore[override]
        from .profiling import METHOD

        return METHOD

    @property
    def merged_phases(self) -> dict[str, str]:  # type: ignore[override]
        from .profiling import merged_phases

        return merged_phases(self.world_size)

    def annotate(self, name: str) -> contextlib.AbstractContextManager:
        from .profiling import annotate

        return annotate(name)

    def profiler(self, trace_dir: str | None) -> contextlib.AbstractContextManager:
        from .profiling import profiler

        return profiler(self, trace_dir)

    def head_has_backward(self) -> bool | None:
        # The compiled phase holds the head and its backward alike.
        return None if self.train_step.head is None else True

    def profiled_step(self, index: int, clock: PhaseClock, variant: str) -> Any:
        import jax

        with clock.phase("data"):
            batch = self.batch()
            # A real batch's copy and normalisation are queued on the device: finish them
            # here, or they would count in the compiled step.
            jax.block_until_ready(batch)
        with clock.phase(compiled_step_phase(self.world_size)):
            loss = self.train_step(*batch)
        return loss

    def matmul_rate(self) -> tuple[float, str]:
        from .profiling import matmul_rate

        return matmul_rate(self.layout.devices[self.rank], self.spec.workload.precision)

    def align_state(self) -> StepState:
        from .alignment import step_state

        return step_state(self.train_step)

    def skipped_steps(self) -> list[int]:
        return self.train_step.skipped_steps()

    def loss_scale(self) -> float | None:
        return self.train_step.loss_scale()

    def memory_over_ranks(self) -> dict:
        return memory_over_ranks(self.layout)

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        return self.layout.gather_host(np.asarray(values, np.float64)).reshape(
            -1, len(values)).tolist()


def main(argv: list[str] | None = None) -> int:
    return worker_entry(argv, __doc__, JaxRun)


if __name__ == "__main__":
    # After its events and JAX's own disconnect (``close``): the interpreter's teardown would
    # race XLA's threads for nothing the run needs.
    leave(main())
