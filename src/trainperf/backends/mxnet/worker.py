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

from ...config import MXNET_KVSTORES, Tuning
from ..workerkit import (FrameworkRun, RealData, StepState, align_dtype, device_used_bytes,
                         environment, cudnn_version, leave, load_init, memory_fields,
                         rss_now_bytes, rss_peak_bytes, tf32_wanted, worker_entry)
from ..phases import NO_COMM, PhaseClock
from . import models, profiling
from .alignment import step_state
from .backend import BACKEND, TF32_OFF
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


def peak_memory(comm: Comm) -> list[tuple[int, ...]]:
    """Per context of this process: on a CPU (peak,), the process's peak resident set; on a
    GPU (peak, reserved, device used). MXNet 1.9 keeps no allocation peak; its pool holds on
    to freed blocks, so the device memory in use after the run (``device_used``: MXNet's
    cudaMemGetInfo, the pool's high-water mark plus the CUDA contexts) is the figure for peak
    and reserved; device used is the CUDA driver's figure for the same device
    (``workerkit.device_used_bytes``, -1 where it cannot say)."""
    if comm.device_type == "gpu":
        rows = []
        for ctx in comm.contexts:
            used = _gpu_used(ctx)
            driver = device_used_bytes(ctx.device_id)
            rows.append((used, used, -1 if driver is None else driver))
        return rows
    return [(rss_peak_bytes(),)]


def memory_over_ranks(comm: Comm) -> dict:
    """The largest figures over ranks, and every rank's peak (a collective call)."""
    values = mx.nd.array(peak_memory(comm), ctx=mx.cpu(), dtype="float64")
    per_rank = comm.all_gather("worker/memory", values).asnumpy()
    gpu = comm.device_type == "gpu"
    return memory_fields(per_rank, with_reserved=gpu, with_device_used=gpu)


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


def _nccl_version(comm: Comm) -> str | None:
    """The NCCL Horovod was built with, where Horovod runs the collectives: its
    ``NCCL_VERSION_CODE`` (major * 10000 + minor * 100 + patch since 2.9, major * 1000 + minor
    * 100 + patch before)."""
    code = int(comm.hvd.nccl_built()) if comm.hvd is not None else 0
    if not code:
        return None
    major, rest = divmod(code, 10000 if code >= 10000 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _compute_capability(ordinal: int) -> int | None:
    """Compute capability x10 of CUDA device ``ordinal`` (after CUDA_VISIBLE_DEVICES), from
    the driver (``libcuda.so.1``: ``mx.util.get_cuda_compute_capability`` opens the unversioned
    name, which only a driver's development files install); None where it cannot say."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR (cuda.h)
    if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), ordinal)
            or cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
            or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)):
        return None
    return major.value * 10 + minor.value


TF32_UNITS_FROM = 80
"""Compute capability (x10) from which a GPU has TF32 units (Ampere)."""
TF32_SWITCH = {
    True: "none: MXNet 1.9.1's own math (cuDNN's CUDNN_DEFAULT_MATH for convolutions; "
          "CUBLAS_TF32_TENSOR_OP_MATH, set by its linalg GEMMs, for Dense and the head)",
    False: "NVIDIA_TF32_OVERRIDE=0 (MXNet 1.9.1 has no TF32 switch of its own)",
}


def tf32_ran(comm: Comm) -> bool | None:
    """Whether fp32 convolutions and matrix products run in TF32 here: the device has TF32
    units and ``NVIDIA_TF32_OVERRIDE`` (the launcher's, ``backend.TF32_OFF``) leaves it on;
    None on a CPU, or where the driver does not say what the device is."""
    if comm.device_type != "gpu":
        return None
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return False
    capability = _compute_capability(comm.contexts[0].device_id)
    return None if capability is None else capability >= TF32_UNITS_FROM


def framework_env(comm: Comm, threads: int | None) -> dict:
    gpu = comm.device_type == "gpu"
    tf32 = tf32_ran(comm)
    return environment(
        "mxnet", mx.__version__, gpu,
        "device memory in use after the run (MXNet keeps no allocation peak; its pool keeps its "
        "high-water mark)", memory_kind="device_used",
        tf32_cudnn=tf32, tf32_matmul=tf32,
        tf32_switch=TF32_SWITCH[os.environ.get("NVIDIA_TF32_OVERRIDE") != "0"],
        device_count=mx.context.num_gpus() if gpu else 0,
        cuda_version=_cuda_version() if gpu else None,
        cudnn_version=_cudnn_version() if gpu else None,
        nccl_version=_nccl_version(comm) if gpu else None,
        horovod_version=_horovod_version(comm),
        kvstore=comm.mode, omp_threads=threads or os.environ.get("OMP_NUM_THREADS"),
        cpu_worker_threads=os.environ.get("MXNET_CPU_WORKER_NTHREADS", "1"),
        cudnn_autotune=os.environ.get("MXNET_CUDNN_AUTOTUNE_DEFAULT") if gpu else None)


def _horovod_version(comm: Comm) -> str | None:
    if comm.hvd is None:
        return None
    import horovod
    return horovod.__version__


def configure(tuning: Tuning, threads: int | None, gpu: bool) -> None:
    """Speed settings, before any network is built."""
    # 1: MXNet's default autotuning within its workspace limit; 0: none.
    os.environ["MXNET_CUDNN_AUTOTUNE_DEFAULT"] = "1" if tuning.cudnn_benchmark else "0"
    if tf32_wanted(tuning, gpu) is False:
        # The launcher set it for the whole process already; this covers a worker started on
        # its own, before cuBLAS and cuDNN make their first handles.
        os.environ.update(TF32_OFF)
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
        configure(spec.tuning, spec.threads, comm.device_type == "gpu")
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

    def applied_tuning(self) -> dict:
        out: dict = {}
        if self.comm.mode in MXNET_KVSTORES:  # one rank on one node talks to no one (local)
            out["mxnet_kvstore"] = self.comm.mode
        if self.comm.device_type == "gpu":
            out["cudnn_benchmark"] = os.environ.get("MXNET_CUDNN_AUTOTUNE_DEFAULT") != "0"
            out["tf32"] = "off" if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0" else "on"
        return out

    def close(self) -> None:
        # Every rank is past the run's last collective. Horovod's shutdown is agreed by all
        # ranks in one cycle of its background threads; a rank leaving without it would cut
        # the gloo connections its peers' background threads still read.
        comm = getattr(self, "comm", None)
        if comm is not None and comm.hvd is not None and comm.distributed:
            mx.nd.waitall()
            comm.hvd.shutdown()

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
    # stops once the workers are done) while MXNet's engine threads still run. Horovod is
    # shut down before (``MXNetRun.close``).
    leave(main())
