"""Entry point of one measured Paddle run: ``python -m trainperf.backends.paddle.worker --spec S
--events E``, one process per rank, started by ``trainperf.backends.spawn`` with the variables
of ``backend.rank_env`` (Paddle's own launcher's names).

The entry, failures, injected faults (``TRAINPERF_FAULT``) and the ``start``/``step``/``end``
events are ``workerkit``'s, as for every framework; this module is Paddle's side of a run.

Timing: ``trainperf.backends.loop``. On a CPU Paddle's dynamic graph runs every operation to
the end before the call returns (and so does the executor that runs the backbone's program in
``static`` mode), so a step's markers are empty and the watcher's stamp after each call is the
step's time. On a GPU kernels are queued on the device's stream: each step
records a ``paddle.device.Event`` on that stream after its last update, and the watcher waits
for it by polling ``Event.query()`` between short sleeps (a sleep releases the GIL, so the main
thread queues the next step meanwhile, whether or not ``Event.synchronize()`` would have); the
window's edges wait with ``paddle.device.synchronize()``.

Compile time (``compile_seconds``, ``End.compile_s``): in ``static`` mode, the seconds dy2static
spends building the backbone's programs inside the first step, timed where Paddle builds them
(``step.ProgramBuilds``); ``dygraph`` builds nothing (0.0).

Speed settings (``tuning.py``): TF32 by Paddle's own switches, set before the model is built,
and read back with ``NVIDIA_TF32_OVERRIDE`` from the launch; cuDNN's exhaustive search from the
launch's ``FLAGS_cudnn_exhaustive_search``. Memory on a GPU is the allocator's
``max_memory_allocated``, with the device's used memory beside it
(``workerkit.device_used_bytes``).

Profiled runs (``run --breakdown``): :meth:`TrainStep.profiled` runs the same step phase by
phase; ``profiling.py`` says how they are timed and traced.

A finished worker leaves with ``os._exit`` once its events are written: Paddle's interpreter
teardown costs about a second per process and decides nothing.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import paddle

from ..phases import PhaseClock
from ..workerkit import (FrameworkRun, RealData, StepState, align_dtype, device_used_bytes,
                         environment, leave, load_init, memory_fields, rss_now_bytes,
                         rss_peak_bytes, worker_entry)
from . import models, profiling, tuning
from .alignment import step_state
from .backend import BACKEND
from .comm import Comm, comm_from_env
from .step import TrainStep, init_batch, synthetic_batch

EVENT_POLL_S = 5e-5


# ---------------------------------------------------------------------------------- memory

def current_memory(comm: Comm) -> int:
    """Memory in use now: allocated device memory on a GPU, this process's resident set on CPU."""
    if comm.device_type == "gpu":
        return int(paddle.device.cuda.memory_allocated(comm.gpu_index))
    return rss_now_bytes()


def peak_memory(comm: Comm) -> tuple[int, ...]:
    """(peak, reserved, device used) on a GPU: Paddle's allocator peaks and the device-wide
    used memory (-1 where the driver cannot say); (peak, peak) of the resident set on CPU."""
    if comm.device_type == "gpu":
        used = device_used_bytes(comm.gpu_index)
        return (int(paddle.device.cuda.max_memory_allocated(comm.gpu_index)),
                int(paddle.device.cuda.max_memory_reserved(comm.gpu_index)),
                -1 if used is None else used)
    rss = rss_peak_bytes()
    return rss, rss


def memory_over_ranks(comm: Comm) -> dict:
    """The largest figures over ranks, and every rank's peak (a collective call)."""
    mine = paddle.to_tensor(np.array([peak_memory(comm)], dtype=np.float64))
    per_rank = comm.all_gather(mine).numpy()
    gpu = comm.device_type == "gpu"
    return memory_fields(per_rank, with_reserved=gpu, with_device_used=gpu)


# ---------------------------------------------------------------------------- environment

def framework_env(comm: Comm, threads: int | None) -> dict:
    gpu = comm.device_type == "gpu"
    fields = {}
    if gpu:
        nccl = getattr(paddle.version, "nccl", None)
        fields = {"device_count": paddle.device.cuda.device_count(),
                  "cuda_version": paddle.version.cuda(), "cudnn_version": paddle.version.cudnn(),
                  "nccl_version": nccl() if callable(nccl) else None}
    return environment("paddle", paddle.__version__, gpu,
                       "paddle.device.cuda.max_memory_allocated",
                       memory_kind="allocator_peak", **tuning.tf32_fields(gpu),
                       paddle_commit=getattr(paddle.version, "commit", None),
                       collective_backend=comm.backend,
                       omp_threads=threads or os.environ.get("OMP_NUM_THREADS"), **fields)


def configure(threads: int | None) -> None:
    """Intra-op threads on CPU (the runner sets OMP_NUM_THREADS too, before Paddle starts)."""
    if threads:
        paddle.base.core.set_num_threads(int(threads))


# ------------------------------------------------------------------------------------ run

class PaddleRun(FrameworkRun):
    backend = BACKEND

    def connect(self) -> None:
        # Distributed: a failed rank leaves at once, as Paddle's exit would wait on peers stuck
        # in a collective.
        self.comm = comm_from_env(self.spec.device)
        self.join(self.comm)

    def memory_now(self) -> int:
        return current_memory(self.comm)

    def build(self) -> None:
        spec, comm = self.spec, self.comm
        configure(spec.threads)
        tuning.configure(spec.tuning, comm.device_type == "gpu")
        init = load_init(spec)
        self.train_step = TrainStep(spec.workload, comm, spec.tuning, init=init, align=spec.align,
                                    mode=self.mode)
        if spec.data is not None:
            self.real = RealData(spec, [comm.rank], comm.world_size, self.real_batch)
            return
        self.images, self.labels = (
            init_batch(spec.workload, init, comm.rank, align_dtype(spec)) if init is not None
            else synthetic_batch(spec.workload, comm.rank))

    def real_batch(self, images: np.ndarray, labels: np.ndarray, position: int
                   ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """A real batch on the device: the uint8 NHWC images copied over, then made NCHW
        float32 and normalised there."""
        mean, std = self.real.constants(position, lambda *ms: [
            paddle.to_tensor(v, dtype="float32").reshape([1, 3, 1, 1]) for v in ms])
        x = paddle.to_tensor(images).transpose([0, 3, 1, 2]).astype("float32")
        return (x - mean) / std, paddle.to_tensor(labels)

    def start_fields(self, baseline: int) -> dict:
        step, comm = self.train_step, self.comm
        settings = {**step.settings, "ddp": None,
                    "cudnn_benchmark": self.applied_tuning().get("cudnn_benchmark")}
        return {"env": framework_env(comm, self.spec.threads), "settings": settings,
                "backbone_params": models.param_count(step.net), "pfc_update": step.pfc_update}

    def applied_tuning(self) -> dict:
        comm = self.comm
        return tuning.applied(self.spec.tuning, comm.device_type == "gpu", comm.distributed)

    def compile_count(self) -> int | None:
        return self.train_step.compile_count()

    def compile_seconds(self) -> float | None:
        return self.train_step.compile_seconds()

    def compile_measure(self) -> str | None:
        return self.train_step.compile_measure()

    def step(self, index: int) -> paddle.Tensor:
        if self.real is not None:
            return self.train_step(*self.real.next()[0])
        return self.train_step(self.images, self.labels)

    def markers(self) -> list:
        """Nothing on a CPU (the step has run), an event recorded on the current stream on a
        GPU."""
        if self.comm.device_type != "gpu":
            return []
        event = paddle.device.Event()
        event.record()
        return [event]

    def wait(self, markers) -> None:
        for event in markers:
            while not event.query():
                time.sleep(EVENT_POLL_S)

    def sync(self) -> None:
        if self.comm.device_type == "gpu":
            paddle.device.synchronize()

    def barrier(self) -> None:
        self.comm.barrier()

    def read_losses(self, outputs: list) -> list[float]:
        # float64 holds a float32 loss exactly and an alignment run's float64 one as it is.
        return [float(v) for v in paddle.stack(outputs).astype("float64").numpy()]

    # -- profiled runs ------------------------------------------------------------------------
    merged_phases: dict[str, str] = {}
    # can_skip_comm stays False: the all-reduce never overlaps the backward, grad_comm times it.

    @property
    def phase_method(self) -> str:
        return profiling.method(self.comm, self.train_step)

    def annotate(self, name: str) -> contextlib.AbstractContextManager:
        return profiling.annotate(name)

    def profiler(self, trace_dir: str | None) -> contextlib.AbstractContextManager:
        return profiling.Profiler(self, trace_dir)

    def head_has_backward(self) -> bool | None:
        return None if self.train_step.head is None else True

    def profiled_step(self, index: int, clock: PhaseClock, variant: str) -> paddle.Tensor:
        with clock.phase("data"):
            images, labels = (self.real.next()[0] if self.real is not None
                              else (self.images, self.labels))
        return self.train_step.profiled(images, labels, clock)

    def matmul_rate(self) -> tuple[float, str]:
        return profiling.matmul_rate(self.comm, self.spec.workload.precision)

    def align_state(self) -> StepState:
        return step_state(self.train_step)

    def memory_over_ranks(self) -> dict:
        return memory_over_ranks(self.comm)

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        mine = paddle.to_tensor(np.array([values], dtype=np.float64))
        return self.comm.all_gather(mine).numpy().tolist()


def main(argv: list[str] | None = None) -> int:
    return worker_entry(argv, __doc__, PaddleRun)


if __name__ == "__main__":
    # Paddle's interpreter teardown (its C++ destructors) takes about a second per process.
    leave(main())
