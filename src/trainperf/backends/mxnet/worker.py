"""Entry point of one measured MXNet run: ``python -m trainperf.backends.mxnet.worker --spec S
--events E``, started by ``launch.py`` (one process per rank, or one for all contexts).

The entry, failures, injected faults (``TRAINPERF_FAULT``) and the ``start``/``step``/``end``
events are ``workerkit``'s, as for every framework; this module is MXNet's side of a run.

Modes: the step's backbone runs hybridized (``hybrid``, the default) or imperative
(``imperative``), as ``workerkit`` resolved the spec's mode (``step.py``). Compile time
(``compile_seconds``): in ``hybrid``, the host seconds inside Gluon's ``_build_cache`` (the
trace and the ``CachedOp``'s construction) at every build, which happens inside step 0's call
of the network; the ``CachedOp``'s own memory planning inside its first forward and backward is
not in it (``step.GraphBuilds``). In ``imperative``, 0.0: nothing is built.

Timing: ``trainperf.backends.loop`` (MXNet runs every operation asynchronously on its engine);
a step's markers are small arrays that become ready when the step's last update has run
(``TrainStep.markers``), waited on with ``wait_to_read``, which releases the GIL.

Profiled runs (``spec.profile``, ``--breakdown``): ``TrainStep.profiled`` runs the same step
phase by phase, each phase fenced by ``mx.nd.waitall`` and named in MXNet's profiler
(``profiling.py``).

Strict alignment (``spec.align``): the start file's weights and batches, the run in the spec's
dtype, and after every step the state ``workerkit`` dumps (``align_state``, ``alignment.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import mxnet as mx

from ...config import Tuning
from ..workerkit import (FrameworkRun, RealData, StepState, align_dtype, environment,
                         cudnn_version, leave, load_init, memory_fields, rss_now_bytes,
                         rss_peak_bytes, worker_entry)
from ..phases import NO_COMM, PhaseClock
from . import models, profiling
from .alignment import step_state
from .backend import BACKEND
from .comm import Comm, comm_from_env
from .step import TrainStep, init_batch, label_dtype, synthetic_batch


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
    return environment(
        "mxnet", mx.__version__, gpu,
        "device memory in use after the run (MXNet keeps no allocation peak; its pool keeps its "
        "high-water mark)",
        device_count=mx.context.num_gpus() if gpu else 0,
        cuda_version=_cuda_version() if gpu else None,
        cudnn_version=_cudnn_version() if gpu else None,
        kvstore=comm.mode, omp_threads=threads or os.environ.get("OMP_NUM_THREADS"),
        cpu_worker_threads=os.environ.get("MXNET_CPU_WORKER_NTHREADS", "1"),
        cudnn_autotune=os.environ.get("MXNET_CUDNN_AUTOTUNE_DEFAULT") if gpu else None)


def configure(tuning: Tuning, threads: int | None) -> None:
    """Speed settings, before any network is built."""
    # 1: MXNet's default autotuning within its workspace limit; 0: none.
    os.environ["MXNET_CUDNN_AUTOTUNE_DEFAULT"] = "1" if tuning.cudnn_benchmark else "0"
    if threads:
        mx.base.check_call(mx.base._LIB.MXSetNumOMPThreads(ctypes.c_int(int(threads))))


# ------------------------------------------------------------------------------------ run

class MXNetRun(FrameworkRun):
    backend = BACKEND

    def connect(self) -> None:
        # Distributed: a failed rank leaves at once, as a normal exit would finalize the kvstore.
        self.comm = comm_from_env(self.spec.device)
        self.join(self.comm)

    def memory_now(self) -> int:
        return current_memory(self.comm)

    def build(self) -> None:
        spec, comm = self.spec, self.comm
        configure(spec.tuning, spec.threads)
        init = load_init(spec)
        self.train_step = TrainStep(spec.workload, comm, spec.tuning, init=init,
                                    align=spec.align, mode=self.mode)
        dtype = align_dtype(spec)
        if spec.data is not None:
            self.real = RealData(spec, comm.ranks, comm.world_size, self.real_batch)
            return
        self.batches = [init_batch(spec.workload, init, rank, ctx, dtype) if init is not None
                        else synthetic_batch(spec.workload, rank, ctx)
                        for ctx, rank in zip(comm.contexts, comm.ranks)]

    def real_batch(self, images, labels, position: int) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
        """A real batch on context ``position``: the uint8 NHWC images copied over, then made
        NCHW float32 and normalised there; the labels as ``step.to_device`` gives them."""
        ctx = self.comm.contexts[position]
        mean, std = self.real.constants(position, lambda *ms: [
            mx.nd.array(v, ctx=ctx).reshape((1, 3, 1, 1)) for v in ms])
        x = mx.nd.array(images, ctx=ctx, dtype="uint8").transpose((0, 3, 1, 2)).astype("float32")
        return (mx.nd.broadcast_div(mx.nd.broadcast_sub(x, mean), std),
                mx.nd.array(labels, ctx=ctx, dtype=label_dtype(self.spec.workload)))

    def start_fields(self, baseline: int) -> dict:
        step, comm = self.train_step, self.comm
        settings = {**step.settings, "ddp": None,
                    "cudnn_benchmark": self.spec.tuning.cudnn_benchmark
                    if comm.device_type == "gpu" else None}
        return {"env": framework_env(comm, self.spec.threads), "settings": settings,
                "backbone_params": models.param_count(step.net),
                "pfc_update": step.pfc_update}

    def compile_count(self) -> int | None:
        return self.train_step.compile_count()

    def compile_seconds(self) -> float:
        return self.train_step.compile_seconds()

    def compile_measure(self) -> str:
        return self.train_step.compile_measure()

    def step(self, index: int) -> mx.nd.NDArray:
        return self.train_step(self.real.next() if self.real is not None else self.batches)

    def wait(self, markers) -> None:
        for array in markers:
            array.wait_to_read()

    def sync(self) -> None:
        mx.nd.waitall()

    def barrier(self) -> None:
        self.comm.barrier()

    def oom_error(self, message: str) -> BaseException:
        return mx.base.MXNetError(message)

    def read_losses(self, outputs: list) -> list[float]:
        host = [loss.reshape((1,)).as_in_context(mx.cpu()) for loss in outputs]
        return [float(v) for v in mx.nd.concat(*host, dim=0).asnumpy()]

    def align_state(self) -> StepState:
        return step_state(self.train_step)

    def memory_over_ranks(self) -> dict:
        return memory_over_ranks(self.comm)

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        mine = mx.nd.array([values], ctx=mx.cpu(), dtype="float64")
        return self.comm.all_gather("worker/floats", mine).asnumpy().tolist()

    # -- profiled runs ------------------------------------------------------------------------
    merged_phases: dict[str, str] = {}
    collectives: dict[str, list[str]] | None = None

    @property
    def phase_method(self) -> str:
        return profiling.method(self.comm.world_size > 1, bool(self.train_step.heads))

    @functools.cached_property
    def ranges(self) -> profiling.Ranges:
        return profiling.Ranges()

    def annotate(self, name: str) -> contextlib.AbstractContextManager:
        return self.ranges(name)

    def profiler(self, trace_dir: str | None) -> contextlib.AbstractContextManager:
        return profiling.Profiler(self, trace_dir)

    def head_has_backward(self) -> bool | None:
        return True if self.train_step.heads else None

    def can_skip_comm(self) -> bool:
        return self.comm.world_size > 1

    def profiled_step(self, index: int, clock: PhaseClock, variant: str) -> mx.nd.NDArray:
        with clock.phase("data"):
            batches = self.real.next() if self.real is not None else self.batches
        return self.train_step.profiled(batches, clock, skip_comm=variant == NO_COMM)

    def matmul_rate(self) -> tuple[float, str]:
        step = self.train_step
        return profiling.matmul_rate(self.comm.contexts[0], "float16" if step.fp16 else "float32")

    def collectives_by_phase(self) -> dict[str, list[str]] | None:
        return self.collectives


def main(argv: list[str] | None = None) -> int:
    return worker_entry(argv, __doc__, MXNetRun)


if __name__ == "__main__":
    # Once its events are written the worker leaves without the interpreter's teardown: that
    # would finalize ps-lite (a last barrier with the scheduler and servers, which the launcher
    # stops once the workers are done) while MXNet's engine threads still run.
    leave(main())
