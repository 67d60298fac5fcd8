"""Entry point of one measured TensorFlow run: ``python -m trainperf.backends.tf.worker --spec S
--events E``, one process per rank started by ``trainperf.backends.spawn`` with ``TF_CONFIG``
(``backend.rank_env``).

The entry, failures, injected faults (``TRAINPERF_FAULT``) and the ``start``/``step``/``end``
events are ``workerkit``'s, as for every framework; this module is TensorFlow's side of a run.

Timing: ``trainperf.backends.loop``. A call of the step's ``tf.function`` may return before its
work is done on a GPU, so a step's markers are its output tensors (the loss and the step counter
read after the last update) and the watcher thread waits on them by reading them back
(``.numpy()`` of two scalars): TensorFlow has no public wait that copies nothing, and these
few bytes, read by the watcher and never by the loop, are the one read-back in the window. The
window's edges wait for all device work with ``tf.test.experimental.sync_devices`` in one
process, and on the last step's markers with several (where ``sync_devices`` would reach for the
other workers' devices).

Compilation: step 0 traces the Python step into a graph, explicitly and timed, then its call
optimises the graph (``--mode function``) or compiles it into one XLA program (``--mode xla``):
all of it inside step 0's time. ``compile_seconds`` is the tracing and, under XLA, the compilation
as TensorFlow itself times it (``compiling.py`` says where each is timed and what is left out).
``compile_count`` is the step function's tracing count, 1 from step 0 on: another trace is a
recompilation.

Strict alignment (``AlignSpec``): the step is built in the asked dtype from the start file, and
``align_state`` reads its variables back in torch's names and layouts after each step, with the
gradient norm and rate the step kept on the device (``TrainStep(keep_state=True)``).
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import tensorflow as tf

from ...config import Tuning
from ..phases import PhaseClock, compiled_step_phase
from ..workerkit import (FrameworkRun, RealData, StepState, align_dtype, breaks_margin,
                         device_used_bytes, dumps_state, environment, leave, load_init,
                         memory_fields, rss_now_bytes, rss_peak_bytes, tf32_ran, tf32_wanted,
                         worker_entry)
from . import models, profiling
from ..base import xla_autotunes
from .backend import BACKEND
from .comm import Comm
from .compiling import CompileClock
from .departure import Departure
from .step import TrainStep, init_batch, synthetic_batch


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
    """The largest peak over ranks, and every rank's (a collective call); on GPUs also the
    device-wide used memory (``device_used_bytes``; -1 where a rank could not read it)."""
    row = [peak_memory(comm)]
    gpu = comm.device_type == "gpu"
    if gpu:
        used = device_used_bytes(0)  # the one device CUDA_VISIBLE_DEVICES leaves this rank
        row.append(-1 if used is None else used)
    per_rank = comm.gather_rows(np.array(row, dtype=np.float64))
    return memory_fields(per_rank.reshape(-1, len(row)), with_reserved=False,
                         with_device_used=gpu)


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


TF32_SWITCH = "tf.config.experimental.enable_tensor_float_32_execution"
"""TensorFlow's one switch for TF32 in fp32 convolutions and matrix products alike, in its own
kernels and in XLA's (the tf2xla convolution and dot kernels ask for HIGHEST precision when it
is off)."""


def apply_tf32(tuning: Tuning, gpu: bool) -> None:
    """``Tuning.tf32`` with TensorFlow's switch, before anything is built; nothing on a CPU."""
    wanted = tf32_wanted(tuning, gpu)
    if wanted is not None:
        tf.config.experimental.enable_tensor_float_32_execution(wanted)


def tf32_enabled(gpu: bool) -> bool | None:
    """Whether TensorFlow runs fp32 work in TF32, as it says; None on a CPU."""
    return bool(tf.config.experimental.tensor_float_32_execution_enabled()) if gpu else None


def tf32_fields(gpu: bool) -> dict:
    """``environment``'s TF32 fields: TensorFlow's switch, unless the process's
    NVIDIA_TF32_OVERRIDE=0 turns TF32 off beneath it (None on a CPU)."""
    on, switch = tf32_ran(tf32_enabled(gpu), TF32_SWITCH)
    return {"tf32_cudnn": on, "tf32_matmul": on, "tf32_switch": switch if gpu else None}


def env_flag(name: str, default: bool) -> bool:
    """A boolean variable as TensorFlow's ``ReadBoolFromEnvVar`` reads it."""
    value = os.environ.get(name, "").strip().lower()
    return {"1": True, "true": True, "0": False, "false": False}.get(value, default)


def framework_env(comm: Comm, threads: int | None) -> dict:
    gpu = comm.device_type == "gpu"
    build = tf.sysconfig.get_build_info()
    return environment(
        "tensorflow", tf.__version__, gpu,
        "allocator peak (tf.config.experimental.get_memory_info()['peak'])",
        memory_kind="allocator_peak", **tf32_fields(gpu),
        keras_version=_version_of("keras"),
        device_count=len(tf.config.list_physical_devices("GPU")) if gpu else 0,
        cuda_version=build.get("cuda_version") if gpu else None,
        cudnn_version=build.get("cudnn_version") if gpu else None,
        collective=comm.communication,
        intra_op_threads=tf.config.threading.get_intra_op_parallelism_threads() or None,
        inter_op_threads=tf.config.threading.get_inter_op_parallelism_threads() or None,
        threads_asked=threads)


# ------------------------------------------------------------------------------------ run

class TFRun(FrameworkRun):
    backend = BACKEND
    departure: Departure | None = None

    def connect(self) -> None:
        # TF_CUDNN_USE_AUTOTUNE and XLA_FLAGS come from the launch (backend.tuning_env).
        # Distributed: a failing rank leaves at once, as TensorFlow's shutdown would wait on
        # peers stuck in a collective; the launcher stops them.
        self.comm = Comm.create(self.spec.device, self.spec.threads)
        apply_tf32(self.spec.tuning, self.comm.device_type == "gpu")
        self.join(self.comm)
        # Rank 0 listens before its first collective, so before any rank can be past the last
        # one; after join, so that a port taken here fails the run like a failed collective.
        self.departure = Departure.from_env()
        self.outputs: list[tuple] = []

    def memory_now(self) -> int:
        return current_memory(self.comm)

    def close(self) -> None:
        # Reached after the run's last barrier (a failed distributed run leaves before this).
        unheard = self.departure.leave_together() if self.departure is not None else []
        if unheard:
            print(f"trainperf: ranks {unheard} were never heard past the last barrier",
                  file=sys.stderr)

    def build(self) -> None:
        spec, comm, align = self.spec, self.comm, self.spec.align
        init = load_init(spec)
        dtype = align_dtype(spec)
        self.train_step = TrainStep(
            spec.workload, comm, init=init, dtype=dtype, keep_state=dumps_state(align),
            straight_through=breaks_margin(align), mode=self.mode,
            pack_bytes=self.pack_bytes())
        self.clock = CompileClock(self.train_step, xla=self.mode == "xla")
        if spec.data is not None:
            self.real = RealData(spec, [comm.rank], comm.world_size, self.real_batch)
            return
        self.images, self.labels = (
            init_batch(spec.workload, init, comm.rank, comm.tf_device, dtype) if init is not None
            else synthetic_batch(spec.workload, comm.rank, comm.tf_device))

    def real_batch(self, images: np.ndarray, labels: np.ndarray, position: int
                   ) -> tuple[tf.Tensor, tf.Tensor]:
        """A real batch on the device: the uint8 NHWC images copied over, normalised there in
        float32, then in the step's input dtype (``step.to_device``'s)."""
        half = self.spec.workload.precision == "fp16"
        with tf.device(self.comm.tf_device):
            mean, std = self.real.constants(position, lambda *ms: [
                tf.constant(v, tf.float32) for v in ms])
            x = (tf.cast(tf.convert_to_tensor(images), tf.float32) - mean) / std
            return (tf.cast(x, tf.float16) if half else x,
                    tf.convert_to_tensor(labels.astype(np.int32)))

    def pack_bytes(self) -> int:
        """``--ddp-bucket-mb`` as the gradient all-reduce's pack size."""
        return int(self.spec.tuning.ddp_bucket_mb * 2**20)

    def applied_tuning(self) -> dict:
        applied = {"tf_onednn": onednn_opts()}
        if applied["tf_onednn"] is None:
            applied["tf_onednn"] = env_flag("TF_ENABLE_ONEDNN_OPTS", False)
        if self.comm.distributed:
            applied["ddp_bucket_mb"] = self.spec.tuning.ddp_bucket_mb
        if self.comm.device_type == "gpu":
            applied["cudnn_benchmark"] = (xla_autotunes(os.environ.get("XLA_FLAGS", ""))
                                          if self.mode == "xla"
                                          else env_flag("TF_CUDNN_USE_AUTOTUNE", True))
            applied["tf32"] = "on" if tf32_fields(True)["tf32_matmul"] else "off"
        return applied

    def compile_count(self) -> int | None:
        # Each trace of the step is a new graph (and, under XLA, a new compilation).
        return self.train_step.traces

    def compile_seconds(self) -> float | None:
        return self.clock.seconds()

    def compile_measure(self) -> str | None:
        return self.clock.measure()

    def start_fields(self, baseline: int) -> dict:
        step, comm = self.train_step, self.comm
        settings = {**step.settings, "ddp": None, "onednn_opts": onednn_opts(),
                    "cudnn_benchmark": self.applied_tuning().get("cudnn_benchmark")}
        return {"env": framework_env(comm, self.spec.threads), "settings": settings,
                "backbone_params": models.param_count(step.backbone),
                "pfc_update": step.pfc_update}

    def batch(self) -> tuple[tf.Tensor, tf.Tensor]:
        """This step's (images, labels) on the device."""
        return self.real.next()[0] if self.real is not None else (self.images, self.labels)

    def step(self, index: int) -> tuple:
        return self._run_step(self.batch())

    def _run_step(self, batch: tuple[tf.Tensor, tf.Tensor]) -> tuple:
        out = self.clock(*batch)
        self.outputs.append(out)
        return out

    def markers(self) -> tuple:
        return self.outputs[-1][:2]

    def wait(self, markers) -> None:
        for array in markers:
            array.numpy()

    def sync(self) -> None:
        if not self.comm.distributed:
            tf.test.experimental.sync_devices()
        elif self.outputs:
            # sync_devices would also sync the other workers' devices, which a multi-worker
            # eager context refuses; the last step's markers depend on all of its work.
            self.wait(self.outputs[-1][:2])

    def barrier(self) -> None:
        self.comm.barrier()

    def oom_error(self, message: str) -> BaseException:
        return tf.errors.ResourceExhaustedError(None, None, message)

    def read_losses(self, outputs: list) -> list[float]:
        return [float(v) for v in tf.stack([o[0] for o in outputs]).numpy()]

    # -- profiled runs (``profiling.py``) -------------------------------------------------------
    @property
    def phase_method(self) -> str:  # type: ignore[override]
        return profiling.method(self.mode)

    @property
    def merged_phases(self) -> dict[str, str]:  # type: ignore[override]
        return profiling.merged_phases(self.world_size)

    def annotate(self, name: str) -> contextlib.AbstractContextManager:
        return profiling.annotate(name)

    def profiler(self, trace_dir: str | None) -> contextlib.AbstractContextManager:
        return profiling.profiler(self, trace_dir)

    def head_has_backward(self) -> bool | None:
        # The graph's phase holds the head and its backward alike.
        return None if self.train_step.head is None else True

    def profiled_step(self, index: int, clock: PhaseClock, variant: str) -> tuple:
        with clock.phase("data"):
            batch = self.batch()
        with clock.phase(compiled_step_phase(self.world_size)):
            return self._run_step(batch)

    def matmul_rate(self) -> tuple[float, str]:
        return profiling.matmul_rate(self.comm.tf_device, self.spec.workload.precision)

    def align_state(self) -> StepState:
        step = self.train_step
        arrays = models.torch_arrays(step.backbone)
        if step.head is not None:
            # This rank's rows: the whole matrix in dp, its shard in mp and pfc.
            arrays["head/weight"] = step.head.weight.numpy()
        norm = float(step.grad_norm.numpy())  # NaN before the first step
        return StepState(arrays, None if norm != norm else norm, float(step.rate.numpy()))

    def skipped_steps(self) -> list[int]:
        return [i for i, o in enumerate(self.outputs) if bool(o[2].numpy())]

    def loss_scale(self) -> float | None:
        return float(self.train_step.loss_scale.numpy()) if self.train_step.fp16 else None

    def memory_over_ranks(self) -> dict:
        return memory_over_ranks(self.comm)

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        return self.comm.gather_rows(np.array([values], dtype=np.float64)).tolist()


def main(argv: list[str] | None = None) -> int:
    return worker_entry(argv, __doc__, TFRun)


if __name__ == "__main__":
    # TensorFlow's interpreter teardown takes seconds.
    leave(main())
