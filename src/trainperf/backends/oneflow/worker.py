"""Entry point of one measured OneFlow run: ``python -m trainperf.backends.oneflow.worker --spec S
--events E``, started once per rank by ``trainperf.backends.spawn`` (``backend.py``).

The entry, failures, injected faults (``TRAINPERF_FAULT``) and the ``start``/``step``/``end``
events are ``workerkit``'s, as for every framework; this module is OneFlow's side of a run.

Timing: ``trainperf.backends.loop``. OneFlow's eager mode queues every operation on its virtual
machine and returns, so a step's markers (``TrainStep.markers``: one element of the last arrays
the step updates, copied after the update) are waited on by the loop's watcher thread with
``numpy()``, which releases the GIL while it blocks. The window's edges wait for the virtual
machine (``Dist.sync``). Losses stay on the device until the window has ended.

Modes (``Capabilities.modes``): ``eager`` runs ``step.TrainStep``; ``graph`` runs
``graph_step.GraphTrainStep``, one ``nn.Graph`` whose job OneFlow compiles on the first step
(``compile_count``: how many times its ``build`` was traced) and launches once per step; its
batches are each rank's piece of a global ``split(0)`` batch (``placed``), and a profiled step
is the data and that job as one phase. Compile time (``compile_seconds``): in ``graph``, the
host seconds inside the graph's ``_compile``, OneFlow's own compile path, which its first call
runs inside step 0 (``graph_step.StepGraph``); in ``eager``, 0.0: nothing is compiled.

Speed settings and memory (``tuning.py``): TF32 comes with the launch's variables and is read
back from them; cuDNN's search is set on the session before any graph is built. OneFlow 0.9
keeps no allocator statistics, so on a GPU the memory figure is the device's used memory
(``workerkit.device_used_bytes``, the CUDA driver's, by device, not by process id).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Sequence

from .rendezvous import Departure, wait_for_rank0

# Before OneFlow is imported: the import joins the process group (see rendezvous.py).
wait_for_rank0()

import oneflow as flow  # noqa: E402

from ..workerkit import (FrameworkRun, RealData, StepState, align_dtype, breaks_margin,
                         cudnn_version, device_used_bytes, dumps_state, environment, load_init,
                         memory_fields, leave, rss_now_bytes, rss_peak_bytes, worker_entry)
from ..phases import NO_COMM, PhaseClock, compiled_step_phase
from . import models, profiling, tuning
from .alignment import step_state
from .backend import BACKEND
from .dist import Dist, dist_from_env
from .graph_step import GraphTrainStep, StepGraph
from .step import TrainStep, init_batch, synthetic_batch


# ---------------------------------------------------------------------------------- memory

def device_used(dist: Dist) -> int | None:
    """Device-wide used memory of this rank's GPU (OneFlow 0.9 keeps no allocator statistics;
    its caching allocator keeps what it took, so after a run this holds its peak)."""
    return device_used_bytes(dist.gpu_index)


def current_memory(dist: Dist) -> int:
    """Memory in use now: the device's used memory on a GPU, the resident set on CPU."""
    return (device_used(dist) or 0) if dist.device_type == "cuda" else rss_now_bytes()


def peak_memory(dist: Dist) -> list[float]:
    """(peak, device used) on a GPU, both the device's used memory (-1 where the driver cannot
    say, the peak then 0); (peak,) of the resident set on CPU."""
    if dist.device_type != "cuda":
        return [float(rss_peak_bytes())]
    used = device_used(dist)
    return [float(used or 0), float(-1 if used is None else used)]


def memory_over_ranks(dist: Dist) -> dict:
    """The largest peak over ranks, and every rank's (a collective call)."""
    per_rank = dist.gather_host(peak_memory(dist))
    return memory_fields(per_rank, with_reserved=False,
                         with_device_used=dist.device_type == "cuda")


# ---------------------------------------------------------------------------- environment

def _cudnn_version() -> int | None:
    """cudnnGetVersion() of the cuDNN the environment ships (the ``nvidia-cudnn`` wheel)."""
    site = os.path.dirname(os.path.dirname(flow.__file__))
    return cudnn_version(os.path.join(site, "nvidia", "cudnn", "lib", "libcudnn.so*"))


def framework_env(dist: Dist, threads: int | None) -> dict:
    gpu = dist.device_type == "cuda"
    fields = {}
    if gpu:
        import oneflow.sysconfig
        code = int(oneflow.sysconfig.get_cuda_version())  # e.g. 11070
        fields = {"device_count": flow.cuda.device_count(), "cudnn_version": _cudnn_version(),
                  "cuda_version": f"{code // 1000}.{code % 1000 // 10}"}
    return environment("oneflow", flow.__version__, gpu,
                       "the device's used memory after the run (CUDA driver cuMemGetInfo: "
                       "total - free); OneFlow 0.9 keeps no allocator statistics",
                       memory_kind="device_used", **tuning.tf32_fields(gpu),
                       intra_op_threads=threads, omp_threads=os.environ.get("OMP_NUM_THREADS"),
                       **fields)


# ------------------------------------------------------------------------------------ run

class OneFlowRun(FrameworkRun):
    backend = BACKEND
    departure: Departure | None = None

    def connect(self) -> None:
        if self.spec.threads:
            # Before the first eager operation, as OneFlow asks.
            flow.set_num_threads(int(self.spec.threads))
        self.dist = dist = dist_from_env(self.spec.device)
        self.rank, self.world_size = dist.rank, dist.world_size
        # OneFlow's shutdown meets every other rank; after a failure they may never come.
        self.distributed = dist.distributed
        self.departure = Departure.from_env()
        self.device, self.device_kind = dist.device_name, dist.device_type

    def memory_now(self) -> int:
        return current_memory(self.dist)

    def close(self) -> None:
        # Reached after the run's last barrier (a failed distributed run leaves before this).
        missing = self.departure.leave_after_peers() if self.departure is not None else []
        if missing:
            print(f"trainperf: ranks {missing} never said they were past the last barrier",
                  file=sys.stderr)

    def build(self) -> None:
        spec, dist = self.spec, self.dist
        # Before any graph is built: its convolutions' search is fixed when it compiles.
        tuning.configure(spec.tuning, dist.device_type == "cuda")
        init = load_init(spec)
        align = spec.align
        dtype = getattr(flow, align_dtype(spec))
        step_class = GraphTrainStep if self.graph_mode else TrainStep
        self.train_step = step_class(
            spec.workload, dist, spec.tuning, init=init, dtype=dtype,
            keep_grad_norm=dumps_state(align),
            straight_through=breaks_margin(align))
        if spec.data is not None:
            self.real = RealData(spec, [dist.rank], dist.world_size, self.real_batch)
        else:
            batch = (init_batch(spec.workload, init, dist, dtype)
                     if init is not None else synthetic_batch(spec.workload, dist))
            self.images, self.labels = self.placed(*batch)
        if self.graph_mode:
            # Deliberate, before any step: the graph's compile path starts with an eager Sync,
            # which would otherwise wait on the model's and batch's queued placement and bill
            # it to compile_seconds.
            dist.sync()

    @property
    def graph_mode(self) -> bool:
        """Whether the step is one ``nn.Graph`` (``--mode graph``, ``graph_step.py``)."""
        return self.mode == "graph"

    def placed(self, images: flow.Tensor, labels: flow.Tensor
               ) -> tuple[flow.Tensor, flow.Tensor]:
        """A batch as the step takes it: local in eager mode, this rank's piece of a global
        batch in graph mode."""
        return self.train_step.place(images, labels) if self.graph_mode else (images, labels)

    def compile_count(self) -> int | None:
        """The graph's compilations; None in eager mode, which compiles nothing to count."""
        return self.train_step.compiles if self.graph_mode else None

    def compile_seconds(self) -> float:
        """The graph's compile time (``StepGraph._compile``); 0.0 in eager mode."""
        return self.train_step.compile_s if self.graph_mode else 0.0

    def compile_measure(self) -> str:
        if self.graph_mode:
            return StepGraph.MEASURE
        return "eager: nothing is compiled (each operator is queued as Python calls it)"

    def real_batch(self, images, labels, position: int) -> tuple[flow.Tensor, flow.Tensor]:
        """A real batch on the device: the uint8 NHWC images copied over, then made NCHW
        float32 and normalised there."""
        device = self.dist.device
        mean, std = self.real.constants(position, lambda *ms: [
            flow.tensor(v, dtype=flow.float32, device=device).reshape(1, 3, 1, 1) for v in ms])
        x = flow.tensor(images, device=device).permute(0, 3, 1, 2).to(flow.float32)
        return self.placed((x - mean) / std, flow.tensor(labels, dtype=flow.int64,
                                                         device=device))

    def start_fields(self, baseline: int) -> dict:
        step = self.train_step
        return {"env": framework_env(self.dist, self.spec.threads),
                "settings": {**step.settings,
                             "cudnn_benchmark": self.applied_tuning().get("cudnn_benchmark")},
                "backbone_params": models.param_count(step.backbone),
                "pfc_update": step.pfc_update}

    def applied_tuning(self) -> dict:
        dist = self.dist
        return tuning.applied(self.spec.tuning, dist.device_type == "cuda", self.graph_mode,
                              ddp=not self.graph_mode and dist.distributed)

    def step(self, index: int) -> flow.Tensor:
        if self.real is not None:
            return self.train_step(*self.real.next()[0])
        return self.train_step(self.images, self.labels)

    def wait(self, markers: Sequence[flow.Tensor]) -> None:
        for array in markers:
            array.numpy()

    def sync(self) -> None:
        self.dist.sync()

    def barrier(self) -> None:
        self.dist.barrier()

    def read_losses(self, outputs: list) -> list[float]:
        return [float(v) for v in flow.stack([loss.reshape(()) for loss in outputs]).numpy()]

    # -- profiled runs (``profiling.py``) ------------------------------------------------------
    @property
    def merged_phases(self) -> dict[str, str]:  # type: ignore[override]
        if self.graph_mode:
            return profiling.graph_merged_phases(self.world_size)
        return {}

    @property
    def phase_method(self) -> str:
        if self.graph_mode:
            return profiling.GRAPH_METHOD
        return profiling.method(self.dist, self.train_step)

    def annotate(self, name: str) -> contextlib.AbstractContextManager:
        return profiling.annotate(name)

    def profiler(self, trace_dir: str | None) -> contextlib.AbstractContextManager:
        return profiling.profiler(trace_dir if self.rank == 0 else None)

    def head_has_backward(self) -> bool | None:
        if self.graph_mode:
            return None
        return not self.train_step.head_in_backward

    def can_skip_comm(self) -> bool:
        return not self.graph_mode and self.train_step.ddp is not None

    def profiled_step(self, index: int, clock: PhaseClock, variant: str) -> flow.Tensor:
        with clock.phase("data"):
            if self.real is not None:
                images, labels = self.real.next()[0]
            else:
                images, labels = self.images, self.labels
        if self.graph_mode:
            # One job: the host can only wait for the whole of it.
            with clock.phase(compiled_step_phase(self.world_size)):
                return self.train_step(images, labels)
        return self.train_step.profiled(images, labels, clock, skip_comm=variant == NO_COMM)

    def matmul_rate(self) -> tuple[float, str]:
        return profiling.matmul_rate(self.dist)

    def align_state(self) -> StepState:
        return step_state(self.train_step)

    def memory_over_ranks(self) -> dict:
        return memory_over_ranks(self.dist)

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        return self.dist.gather_host(values).tolist()


def main(argv: list[str] | None = None) -> int:
    return worker_entry(argv, __doc__, OneFlowRun)


if __name__ == "__main__":
    # Once its events are written the worker leaves without the interpreter's teardown, where
    # OneFlow would shut its environment down (a barrier of every rank over its control plane)
    # while its own threads still run; every rank is past the run's last barrier by then.
    leave(main())
