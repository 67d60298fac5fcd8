"""One worker skeleton for every framework (standard library only; numpy where an alignment
start is read): the protocol's entry point and failure handling (``worker_entry``), the
measured run with its ``start``/``step``/``end`` events (``FrameworkRun``, ``measured_run``),
and what workers share around it: out-of-memory recognition, CPU memory figures and limits,
GPU names, and the way out."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, NoReturn, Sequence

from ..config import TUNING_SETTINGS, AlignSpec, Measure, Tuning, Workload
from ..faults import inject, parse_faults
from ..protocol import LAUNCHED_AT_ENV, End, Error, EventWriter, Phases, RunSpec, Start, Step
from .base import Backend, require
from .loop import MAX_STEPS_IN_FLIGHT, StepTimes, timed_loop, use_short_switch_interval
from .phases import NO_COMM, PhaseClock, delays_from_env, matmul_rate
from .spawn import STACK_SIGNAL

OOM_TEXTS = ("out of memory", "std::bad_alloc", "failed to allocate", "cannot allocate memory",
             "memory allocation failed", "cudaerrormemoryallocation", "resource_exhausted",
             "resourceexhaustederror", "resource exhausted",
             # a Python MemoryError that a framework caught and re-raised as its own error, as
             # torch's gloo work does for one raised in a future's callback
             "memoryerror")


def is_oom(exc: BaseException) -> bool:
    """An allocation failure, by type or by the words frameworks put in their messages, here
    or in the error that caused it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError):
            return True
        text = f"{type(exc).__name__} {exc}".lower()
        if any(t in text for t in OOM_TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def device_kind_for(asked: str, gpus: int, framework: str, no_gpu_hint: str = "") -> str:
    """``cuda`` or ``cpu`` for a spec's ``device`` (``auto``: a GPU where the framework sees
    one), given the GPUs ``framework`` sees; ValueError for ``cuda`` without one."""
    if asked not in ("auto", "cuda", "cpu"):
        raise ValueError(f"unknown device {asked!r}; expected auto, cuda or cpu")
    if asked == "cuda" and gpus == 0:
        raise ValueError(f"--device cuda was asked for but {framework} sees no GPU{no_gpu_hint}")
    return "cuda" if asked == "cuda" or (asked == "auto" and gpus > 0) else "cpu"


def limit_cpu_memory(limit_bytes: int | None) -> None:
    """Cap this process's data segment (as the torch worker does on CPU): a run that needs
    more fails with an allocation error instead of taking the machine down."""
    if limit_bytes:
        resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))


def rss_now_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def gpu_names() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


MEMORY_KINDS = ("allocator_peak", "device_used", "resident_set_peak")
"""What a run's ``peak_memory_bytes`` is (``env.memory_kind``): the framework allocator's own
peak, device-wide used memory (where the framework keeps no peak), or, on a CPU, the process's
peak resident set. Figures of different kinds are never ranked against each other."""
CPU_MEMORY = "peak resident set (ru_maxrss)"


def tf32_wanted(tuning: Tuning, gpu: bool) -> bool | None:
    """Whether fp32 convolutions and matrix products are to run in TF32 (``Tuning.tf32``,
    one rule for every framework); None on a CPU, where no TF32 exists."""
    return tuning.tf32 == "on" if gpu else None


def tf32_setting(conv: bool | None, matmul: bool | None) -> str | None:
    """``Tuning.tf32`` as a run applied it, from what its convolutions and matrix products ran
    in: ``on``, ``off``, or ``mixed`` where a framework read them back different; None where
    neither is known."""
    if conv is None and matmul is None:
        return None
    if conv != matmul:
        return "mixed"
    return "on" if conv else "off"


NVIDIA_TF32_OVERRIDE = "NVIDIA_TF32_OVERRIDE"
"""NVIDIA's variable: ``0`` turns TF32 off in cuBLAS and cuDNN for the whole process, whatever
the framework's own switch says (a GPU user's shell may carry it)."""


def tf32_ran(on: bool | None, switch: str | None) -> tuple[bool | None, str | None]:
    """(whether fp32 work ran in TF32, the switches that said so) from the framework's switch
    ``on`` and the process's ``NVIDIA_TF32_OVERRIDE``, which wins where it is 0; None (a CPU)
    stays None."""
    if on is None:
        return None, switch
    override = process_env(NVIDIA_TF32_OVERRIDE)
    said = f"{switch}; {NVIDIA_TF32_OVERRIDE}={'unset' if override is None else override}"
    return on and override != "0", said


def process_env(name: str) -> str | None:
    """A variable as this process's C environment holds it now: what a framework's C++ side
    reads, which ``os.environ`` does not see change when the library sets it itself."""
    import ctypes

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    raw = getenv(name.encode())
    return raw.decode() if raw is not None else None


def device_used_bytes(ordinal: int = 0) -> int | None:
    """Device-wide used memory (total - free) of CUDA device ``ordinal`` as this process
    numbers them (after ``CUDA_VISIBLE_DEVICES``), from the CUDA driver: ``cuMemGetInfo`` in
    the device's primary context, the one every framework's runtime uses, so no context is
    added and nothing depends on matching a PID (which a container's own PID namespace
    breaks). None where no driver or device answers."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), ordinal)
            or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)):
        return None
    try:
        if cuda.cuCtxPushCurrent_v2(ctx):
            return None
        try:
            failed = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(dev)
    return None if failed else int(total.value - free.value)


def environment(framework: str, version: str, gpu: bool, gpu_memory_measure: str, *,
                memory_kind: str, tf32_cudnn: bool | None = None,
                tf32_matmul: bool | None = None, tf32_switch: str | None = None,
                **fields: Any) -> dict[str, Any]:
    """``Start.env`` in the shape every worker writes (the report reads these keys): the
    framework's and numpy's versions, the device kind and, on a GPU, the device names
    (nvidia-smi's); what memory the figures measure and its kind (``MEMORY_KINDS``; on a CPU,
    the peak resident set); whether fp32 convolutions (``tf32_cudnn``) and matrix products
    (``tf32_matmul``) ran in TF32 and the framework's switch that said so (None on a CPU).
    ``fields`` give the rest (counts and CUDA versions the framework knows, its own settings)."""
    import numpy as np

    if memory_kind not in MEMORY_KINDS:
        raise ValueError(f"memory_kind must be one of {MEMORY_KINDS}, got {memory_kind!r}")
    env = {"framework": framework, "framework_version": version, "numpy_version": np.__version__,
           "device_type": "cuda" if gpu else "cpu", "device_names": gpu_names() if gpu else [],
           "device_count": 0, "cuda_version": None, "cudnn_version": None, "nccl_version": None,
           "memory_measure": gpu_memory_measure if gpu else CPU_MEMORY,
           "memory_kind": memory_kind if gpu else "resident_set_peak",
           "tf32_cudnn": tf32_cudnn if gpu else None, "tf32_matmul": tf32_matmul if gpu else None,
           "tf32_switch": tf32_switch if gpu else None}
    env.update(fields)
    return env


def leave(code: int) -> NoReturn:
    """End the process now, without the interpreter's teardown: every event is written (each
    line in one ``write``) and every rank is past its last collective, so nothing the run needs
    is left, while a framework's C++ destructors and atexit hooks, racing with its own
    background threads, can still crash a process that has finished its work (seen as a
    SIGABRT after the last step) or take seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class FrameworkRun:
    """One framework's side of a measured run. A framework's ``worker.py`` subclasses it with
    what is its own (joining its process group, building the model and step, its device's
    sync and memory figures) and hands the class to ``worker_entry``; the spec, failures, the
    ``start``/``step``/``end`` events, injected faults and the measured loop are here, once.

    ``connect`` sets ``rank``, ``world_size``, ``distributed``, ``device`` (as ``Start.device``
    spells it: ``cuda:0``, ``cpu``) and ``device_kind`` (``cpu`` or ``cuda``)."""

    backend: Backend | None = None
    """The framework's ``BACKEND``: the worker checks the spec against its declaration too,
    on the device it found."""
    start_after_first_step = False
    """Write ``start`` when step 0 is done (its settings report the first step's compile
    time), and with what is known if the run fails before."""
    rank = 0
    world_size = 1
    distributed = False
    device = "cpu"
    device_kind = "cpu"
    mode = ""
    """The execution mode this run's step is built in (``Capabilities.modes``), set from the
    spec's ``tuning.mode`` once the device is known, before ``build``."""
    train_step: Any = None
    """The framework's step, made by ``build``: the defaults of ``markers``, ``skipped_steps``
    and ``loss_scale`` read its attributes of those names."""
    real: "RealData | None" = None
    """Real data (``RunSpec.data``): the feed ``build`` opened; None: synthetic batches."""

    def __init__(self, spec: RunSpec) -> None:
        if not self.backend.capabilities.channels_first and not spec.workload.channels_last:
            # The start event records the spec's workload: it says the one layout the
            # backbones have, whatever a spec made outside `trainperf run` (an alignment, a
            # check) left there.
            spec = replace(spec, workload=spec.workload.replace(channels_last=True))
        self.spec = spec

    @classmethod
    def rank_before_connect(cls) -> int:
        """The rank that signs an error raised before ``connect`` has learnt the real one."""
        return int(os.environ.get("TRAINPERF_LOCAL_RANK", "0"))

    def join(self, group: Any) -> None:
        """Take the layout from a framework's process-group object that has ``rank``,
        ``world_size``, ``distributed``, ``device`` and ``device_type`` (``gpu`` or ``cpu``:
        MXNet's, Paddle's and TensorFlow's names)."""
        self.rank, self.world_size = group.rank, group.world_size
        self.distributed, self.device = group.distributed, group.device
        self.device_kind = "cuda" if group.device_type == "gpu" else "cpu"

    # -- what a framework supplies ------------------------------------------------------------
    def connect(self) -> None:
        raise NotImplementedError

    def memory_now(self) -> int:
        """Memory in use now (before the model is built: the run's baseline)."""
        raise NotImplementedError

    def build(self) -> None:
        """The model, head, optimizer and batches (``load_init`` for an alignment start)."""
        raise NotImplementedError

    def start_fields(self, baseline: int) -> dict[str, Any]:
        """``Start``'s ``env``, ``settings``, ``backbone_params``, ``pfc_update`` (and any
        other field the framework knows); ``baseline``: the memory in use before ``build``."""
        raise NotImplementedError

    def step(self, index: int) -> Any:
        """Train step ``index``; what it returns (its loss, on the device) is kept."""
        raise NotImplementedError

    def markers(self) -> Sequence[Any]:
        """What the loop's watcher waits on for the step just issued (``loop``)."""
        return self.train_step.markers

    def wait(self, markers: Sequence[Any]) -> None:
        """Block until ``markers`` are ready (releasing the GIL)."""

    def sync(self) -> None:
        """Wait until the device has finished all queued work."""

    def barrier(self) -> None:
        """Meet every rank."""

    def oom_error(self, message: str) -> BaseException:
        """The framework's own out-of-memory error (for injected faults)."""
        return MemoryError(message)

    def read_losses(self, outputs: list[Any]) -> list[float]:
        """Every step's loss on the host, read after the window."""
        raise NotImplementedError

    def skipped_steps(self) -> list[int]:
        """Steps whose update fp16 loss scaling skipped."""
        return list(self.train_step.skipped_steps)

    def loss_scale(self) -> float | None:
        """fp16's last loss scale (None in other precisions)."""
        return self.train_step.loss_scale

    def memory_over_ranks(self) -> dict[str, Any]:
        """``End``'s memory fields over every rank (a collective call, ``memory_fields``)."""
        raise NotImplementedError

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (the same length on each), in rank order (a collective
        call): how a real-data run's waits reach rank 0."""
        raise NotImplementedError

    def align_state(self) -> StepState:
        """After a step of an alignment run (``AlignSpec.dump``), with the device synced: this
        rank's state in torch's names and layouts."""
        raise NotImplementedError

    # -- what a framework may change ----------------------------------------------------------
    def timed_loop(self, step: Callable[[int], Any], on_steps: Callable[[StepTimes], None]
                   ) -> tuple[float, list[Any]]:
        """The measured loop: ``loop.timed_loop``'s watcher for frameworks that queue their
        work; a framework with its own device timers runs those (and ``loop_settings``)."""
        measure = self.spec.measure
        return timed_loop(step, self.markers, measure.iters, measure.warmup, on_steps,
                          self.barrier, self.wait, self.sync)

    def applied_tuning(self) -> dict[str, Any]:
        """Each ``config.TUNING_SETTINGS`` setting this run applied, as applied (a GPU-only
        one on a CPU is left out); only settings the backend declares (``Capabilities.
        tuning``). The start event's ``settings["tuning"]`` holds them, None for the rest."""
        return {}

    def loop_settings(self) -> dict[str, Any]:
        """What ``start`` says of the measured loop."""
        return {"max_steps_in_flight": MAX_STEPS_IN_FLIGHT}

    def data_wait(self, index: int) -> float | None:
        """Real data: the host seconds step ``index`` waited for its batch."""
        return self.real.waits[index] if self.real is not None else None

    def end_fields(self) -> dict[str, Any]:
        """More of ``End`` (after the memory figures, a collective call on every rank)."""
        return {}

    def compile_count(self) -> int | None:
        """How many times this run's mode has compiled or traced its step so far (graphs
        captured, programs built, functions traced); None where the framework cannot tell.
        Read after every step is issued (``Step.compiles``) and when the window opens: a change
        inside the window is a recompilation."""
        return None

    def compile_seconds(self) -> float | None:
        """Seconds this process has spent compiling the run's step so far, timed where the
        framework compiles (around its tracing, lowering, graph building or code generation,
        never a step's excess over another); 0.0 in a mode that compiles nothing; None where
        the framework cannot tell. Read once, after the last step (``End.compile_s``)."""
        return None

    def compile_measure(self) -> str | None:
        """What ``compile_seconds`` times, in the framework's own terms, in one line
        (``End.compile_measure``); in a mode that compiles nothing, that it compiles nothing."""
        return None

    def is_oom(self, exc: BaseException) -> bool:
        return is_oom(exc)

    def run(self, events: EventWriter) -> None:
        """The scenario the spec asks for: a measured run (or a profiled one)."""
        measured_run(self, events)

    # -- profiled runs (``RunSpec.profile``, ``phases``) --------------------------------------
    phase_method = "phases closed by a device fence (the framework's sync) and the host clock"
    """How this framework's phases are told apart (``Phases.method``)."""
    merged_phases: dict[str, str] = {
        "data+backbone_forward+head+backward+grad_comm+optimizer":
            "this framework's worker does not split its step into phases"}
    """{merged phase: why} for the phases ``profiled_step`` cannot split."""

    def phase_stamp(self) -> Any:
        """A point in the device's time (``phases.PhaseClock``): by default the device is
        fenced and the host clock read."""
        self.sync()
        return time.perf_counter()

    def phase_elapsed(self, begin: Any, end: Any) -> float:
        return end - begin

    def annotate(self, name: str) -> contextlib.AbstractContextManager:
        """The framework profiler's named range for phase ``name``."""
        return contextlib.nullcontext()

    def profiler(self, trace_dir: str | None) -> contextlib.AbstractContextManager:
        """The framework's profiler around the profiled steps; with ``trace_dir`` it writes its
        trace there and sets ``trace`` (the file) and ``trace_open`` (how to open it)."""
        return contextlib.nullcontext()

    trace: str | None = None
    trace_open: str | None = None

    def head_has_backward(self) -> bool | None:
        """Whether the ``head`` phase holds the head's backward (``Phases.head_has_backward``)."""
        return None

    def can_skip_comm(self) -> bool:
        """Whether ``profiled_step`` can run a step without the gradient all-reduce (``NO_COMM``)
        to measure how much of it the backward hides."""
        return False

    def profiled_step(self, index: int, clock: PhaseClock, variant: str) -> Any:
        """Step ``index`` split into phases with ``clock.phase``; by default one merged phase."""
        with clock.phase(next(iter(self.merged_phases))):
            return self.step(index)

    def matmul_rate(self) -> tuple[float, str] | None:
        """(FLOP/s, what ran) of the framework's own square GEMM on this device."""
        import numpy as np

        a = np.ones((1024, 1024), dtype=np.float32)
        return matmul_rate(lambda: a @ a, 2 * 1024**3, lambda: None), "numpy float32 1024^3"

    def collectives_by_phase(self) -> dict[str, list[str]] | None:
        """{phase: collectives the framework's profiler saw inside it}, after the profiled steps."""
        return None

    def close(self) -> None:
        """After the run, failed or not (a process group to take down, say)."""


def load_init(spec: RunSpec) -> dict[str, Any] | None:
    """An alignment start's arrays (``AlignSpec.start``), or None."""
    if spec.align is None:
        return None
    import numpy as np  # every worker's environment has it; the runner's need not

    with np.load(spec.align.start) as f:
        return {k: f[k] for k in f.files}


def align_dtype(spec: RunSpec) -> str:
    """What the run computes in: an alignment run's ``AlignSpec.dtype``, else float32."""
    return computes_in(spec.align)


def computes_in(align: AlignSpec | None) -> str:
    """``align_dtype`` for the code that holds only the run's ``AlignSpec``."""
    return align.dtype if align is not None else "float32"


def dumps_state(align: AlignSpec | None) -> bool:
    """Whether every step's state is written (``AlignSpec.dump``): the step then keeps what a
    throughput run need not, such as the gradient norm where nothing clips."""
    return align is not None and bool(align.dump)


def breaks_margin(align: AlignSpec | None) -> bool:
    """The straight-through margin control: the margin's gradient passed through unchanged."""
    return align is not None and align.breaks_rule("margin_straight_through")


def start_batch(workload: Workload, arrays: dict[str, Any], rank: int, dtype: str = "float32"
                ) -> tuple[Any, Any]:
    """Rank ``rank``'s batch of an alignment start: NCHW images in ``dtype`` (the file holds
    float32, which float64 holds exactly) and int64 labels (numpy), their shapes checked
    against the workload."""
    import numpy as np

    images, labels = arrays[f"images/{rank}"], arrays[f"labels/{rank}"]
    side = workload.input_size
    if tuple(images.shape) != (workload.batch_size, 3, side, side):
        raise ValueError(f"images/{rank} has shape {tuple(images.shape)}, expected "
                         f"{(workload.batch_size, 3, side, side)}")
    if tuple(labels.shape) != (workload.batch_size,):
        raise ValueError(f"labels/{rank} has shape {tuple(labels.shape)}")
    return np.asarray(images, dtype=dtype), np.asarray(labels, dtype=np.int64)


@dataclass
class StepState:
    """What one rank did in one step of an alignment run, as ``write_dump`` writes it."""

    arrays: dict[str, Any]
    """Every parameter and BatchNorm statistic by torch name (``backbone/<state_dict name>``,
    ``head/weight`` for this rank's rows of the class matrix) in torch's layout, as numpy
    arrays in the dtype the run holds them in."""
    grad_norm: float | None
    """The backbone's gradient norm before clipping (the reduced gradient's: the same on every
    rank); None where the framework computed none (no clipping)."""
    lr: float
    """The rate the framework's optimizer ran this step at (its own schedule's, not
    ``Workload.lr_at``'s)."""


def dump_name(step: int, rank: int) -> str:
    """The file of ``rank``'s state after step ``step`` (``-1``: the start, as loaded, before
    any step)."""
    return f"start-rank-{rank}.npz" if step < 0 else f"step-{step:04d}-rank-{rank}.npz"


def write_dump(folder: str, step: int, rank: int, state: StepState, loss: float) -> None:
    """Write ``dump_name(step, rank)`` in ``folder``: the state's arrays, and ``loss``,
    ``grad_norm`` (NaN for None) and ``lr`` as float64 scalars. Written to a temporary name
    and renamed, so that a reader never sees half a file."""
    import numpy as np

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, dump_name(step, rank))
    scalars = {"loss": loss, "grad_norm": float("nan") if state.grad_norm is None
               else state.grad_norm, "lr": state.lr}
    tmp = path + ".tmp.npz"
    np.savez(tmp, **{k: np.asarray(v) for k, v in state.arrays.items()},
             **{k: np.float64(v) for k, v in scalars.items()})
    os.replace(tmp, path)


class RealData:
    """A worker's real-data batches (``RunSpec.data``): one ``data.feed.LoaderFeed`` per rank
    this process drives, each batch handed to the framework's ``to_device(images, labels,
    position)``, which moves the uint8 NHWC images and int64 labels to the device of the
    ``position``-th of ``ranks`` and normalises them there (``constants``). It records the
    seconds each step waited: for its batch and, as torch's feed counts on a CPU, for that move
    and normalisation too."""

    def __init__(self, spec: RunSpec, ranks: Sequence[int], world_size: int,
                 to_device: Callable[[Any, Any, int], Any]) -> None:
        from ..data.feed import LoaderFeed  # numpy: not every importer of workerkit has it

        assert spec.data is not None
        self.feeds: list[Any] = []
        try:
            for rank in ranks:
                self.feeds.append(LoaderFeed(spec.data, spec.workload, rank, world_size))
        except BaseException:
            self.close()
            raise
        self.mean, self.std = self.feeds[0].mean, self.feeds[0].std
        self.to_device = to_device
        self.waits: list[float] = []
        self.info = {**self.feeds[0].info, "ranks_fed_by_this_process": len(self.feeds)}
        self._constants: dict[int, Any] = {}

    def constants(self, position: int, make: Callable[[Any, Any], Any]) -> Any:
        """``make(mean, std)`` for position ``position``: the normalisation's per-channel
        constants on that rank's device, made for its first batch and kept for the rest."""
        if position not in self._constants:
            self._constants[position] = make(self.mean, self.std)
        return self._constants[position]

    def next(self) -> list[Any]:
        """Every rank's next batch, on its device, in ``ranks`` order."""
        begin = time.perf_counter()
        batches = [self.to_device(*next(feed), i) for i, feed in enumerate(self.feeds)]
        self.waits.append(time.perf_counter() - begin)
        return batches

    def window_waits(self, warmup: int) -> list[float]:
        """The seconds this process waited in the measured window, once per rank it feeds."""
        return [sum(self.waits[warmup:])] * len(self.feeds)

    def close(self) -> None:
        for feed in self.feeds:
            feed.close()


def tuning_record(fw: FrameworkRun) -> dict[str, Any]:
    """``settings["tuning"]``: every ``TUNING_SETTINGS`` name, its value as this run applied it
    or None; a setting the backend does not declare cannot have been applied."""
    applied = fw.applied_tuning()
    declared = fw.backend.capabilities.tuning if fw.backend is not None else None
    if declared is not None and not set(applied) <= set(declared):
        raise RuntimeError(f"the worker applied {sorted(set(applied) - set(declared))}, which "
                           f"its backend does not declare (Capabilities.tuning)")
    return {name: applied.get(name) for name in TUNING_SETTINGS}


def _prepare(fw: FrameworkRun, events: EventWriter) -> tuple[int, int, Callable[[], None],
                                                               Callable[[], bool]]:
    """What every run does before its steps: the spec checked against the framework's
    declaration, the baseline memory and the CPU memory cap, the model and step, and rank 0's
    ``start`` (now, or later through the returned ``write_start``). Returns (baseline, global
    batch, write_start, started)."""
    spec = fw.spec
    workload, measure = spec.workload, spec.measure
    if fw.backend is not None:
        require(fw.backend.work_refusal(workload, fw.device_kind, train=spec.train is not None,
                                        real_data=spec.data is not None))
        fw.mode = fw.backend.resolve_mode(spec.tuning.mode, fw.device_kind)
    else:
        fw.mode = spec.tuning.mode
    baseline = fw.memory_now()
    if fw.device_kind == "cpu":
        limit_cpu_memory(measure.memory_limit_bytes)
    fw.build()
    global_batch = workload.batch_size * fw.world_size
    state = {"started": False}

    def write_start() -> None:
        if state["started"]:
            return
        state["started"] = True
        if fw.rank != 0:
            return
        fields = fw.start_fields(baseline)
        fields["settings"] = {**fields.get("settings", {}), **fw.loop_settings(),
                              "mode": fw.mode, "tuning": tuning_record(fw)}
        if fw.real is not None:
            fields["settings"]["input"] = fw.real.info
        events.emit(Start(world_size=fw.world_size, global_batch=global_batch, device=fw.device,
                          workload=workload.to_dict(), baseline_memory_bytes=baseline,
                          **fields))

    if not fw.start_after_first_step:
        write_start()
    return baseline, global_batch, write_start, lambda: state["started"]


def profiled_run(fw: FrameworkRun, events: EventWriter) -> None:
    """A profiled run (``RunSpec.profile``): ``measure.warmup`` plain steps, then
    ``profile.steps`` steps split into phases inside the framework's profiler, alternating with
    steps that skip the gradient all-reduce where the framework can (``NO_COMM``). Every step
    gets its ``step`` event; rank 0 writes ``phases`` and then ``end``, whose rate covers the
    profiled steps (fenced: never a result)."""
    spec = fw.spec
    measure, profile = spec.measure, spec.profile
    assert profile is not None
    baseline, global_batch, write_start, _ = _prepare(fw, events)
    faults = parse_faults(fw.world_size)
    report = StepReporter(events, fw.rank, measure, global_batch, data_wait=fw.data_wait)
    outputs: list[Any] = []
    clock = PhaseClock(fw.phase_stamp, fw.phase_elapsed, fw.annotate, delays_from_env())
    skip = fw.can_skip_comm()
    try:
        last = time.perf_counter()
        for index in range(measure.warmup):
            inject(faults, index, fw.rank, fw.oom_error)
            outputs.append(fw.step(index))
            fw.sync()
            write_start()
            now = time.perf_counter()
            report([(index, now - last)])
            last = now
        fw.barrier()
        with fw.profiler(profile.trace_dir):
            for j in range(profile.steps):
                index = measure.warmup + j
                inject(faults, index, fw.rank, fw.oom_error)
                variant = NO_COMM if skip and j % 2 else ""
                with clock.step(variant):
                    outputs.append(fw.profiled_step(index, clock, variant))
        fw.sync()
    finally:
        write_start()
    clock.check_delays()
    records = clock.records()
    report([(measure.warmup + j, r["seconds"]) for j, r in enumerate(records)])
    report.check_complete()
    losses = fw.read_losses(outputs)
    memory = fw.memory_over_ranks()
    rate = fw.matmul_rate() if fw.rank == 0 else None
    if fw.rank == 0:
        events.emit(Phases(method=fw.phase_method, steps=records, merged=dict(fw.merged_phases),
                           matmul_flops_per_s=rate[0] if rate else None,
                           matmul_what=rate[1] if rate else None,
                           head_has_backward=fw.head_has_backward(),
                           collectives=fw.collectives_by_phase(), trace=fw.trace,
                           trace_open=fw.trace_open))
        events.emit(End.of_window(sum(r["seconds"] for r in records), measure, global_batch,
                                  losses, fw.skipped_steps(), final_loss_scale=fw.loss_scale(),
                                  baseline_memory_bytes=baseline, **memory))
    fw.barrier()


def measured_run(fw: FrameworkRun, events: EventWriter) -> None:
    """A throughput run (``trainperf.protocol``): the baseline memory and the CPU memory cap,
    the framework's model and step, rank 0's ``start``, ``measure.iters`` steps in the
    measured loop with each step's event as its time is known, the losses and memory read
    after the window, rank 0's ``end``, and a last barrier so that no rank leaves while
    another still talks to it. A fault planned at step ``iters`` strikes after ``end``, as a
    crash at teardown."""
    spec = fw.spec
    if spec.profile is not None:
        return profiled_run(fw, events)
    measure = spec.measure
    baseline, global_batch, write_start, started = _prepare(fw, events)
    faults = parse_faults(fw.world_size)

    dump = spec.align.dump if spec.align is not None else None
    if dump:
        # The start as this framework loaded it: what the first update is measured from.
        write_dump(dump, -1, fw.rank, fw.align_state(), float("nan"))

    compiles: dict[str, int | None] = {}
    counts: dict[int, int | None] = {}

    def one_step(index: int) -> Any:
        inject(faults, index, fw.rank, fw.oom_error)
        if index == measure.warmup and measure.warmup > 0:
            compiles["window"] = fw.compile_count()
        out = fw.step(index)
        # A host-side counter: reading it waits on nothing the device does.
        counts[index] = fw.compile_count()
        if index == 0 and measure.warmup == 0:
            # No warm-up (an alignment run): the first compilation is the run's own, in its
            # window by design; only what compiles after it is a recompilation.
            compiles["window"] = counts[index]
        if dump:
            # An alignment run is not timed for its rate: waiting here costs only its window.
            fw.sync()
            write_dump(dump, index, fw.rank, fw.align_state(), fw.read_losses([out])[0])
        return out

    on_steps = StepReporter(events, fw.rank, measure, global_batch,
                            first=None if started() else write_start, data_wait=fw.data_wait,
                            compiles=counts.get)
    try:
        on_steps.loop_began_at = time.time()
        window_s, outputs = fw.timed_loop(one_step, on_steps)
    except BaseException:
        write_start()
        raise
    on_steps.check_complete()
    losses = fw.read_losses(outputs)
    memory = fw.memory_over_ranks()
    extra = fw.end_fields()
    extra.update(startup_fields(on_steps.first_done_at, compiles.get("window"),
                                fw.compile_count()))
    extra.update(compile_s=fw.compile_seconds(), compile_measure=fw.compile_measure())
    if fw.real is not None:
        fw.real.close()
        waits = fw.gather_floats(fw.real.window_waits(measure.warmup))
        extra["data_wait_s_per_rank"] = [w for row in waits for w in row]
    if fw.rank == 0:
        events.emit(End.of_window(window_s, measure, global_batch, losses, fw.skipped_steps(),
                                  final_loss_scale=fw.loss_scale(),
                                  baseline_memory_bytes=baseline, **memory, **extra))
    inject(faults, measure.iters, fw.rank, fw.oom_error)
    fw.barrier()


def worker_entry(argv: list[str] | None, doc: str, run_class: type[FrameworkRun]) -> int:
    """Parse ``--spec``/``--events``, connect and run ``run_class``, and turn any failure into
    an ``error`` event and the protocol's exit code. A distributed run that failed leaves
    with ``os._exit``: a framework's normal shutdown would wait on peers that will never
    answer; the launcher stops the rest."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="JSON file: workload, measure, device")
    parser.add_argument("--events", required=True, help="JSON-lines file to append events to")
    args = parser.parse_args(argv)
    use_short_switch_interval()
    # A launcher stopping a hung run first asks where each rank is (``spawn.STACK_SIGNAL``).
    faulthandler.register(STACK_SIGNAL, all_threads=True)
    events = EventWriter(args.events, run_class.rank_before_connect())
    fw: FrameworkRun | None = None
    try:
        fw = run_class(RunSpec.load(args.spec))
        fw.connect()
        events.rank = fw.rank
        fw.run(events)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes an event
        error = Error.of_exception(exc, fw.is_oom(exc) if fw is not None else is_oom(exc))
        events.emit(error)
        if fw is not None and fw.distributed:
            leave(error.exit_code)
        return error.exit_code
    finally:
        if fw is not None:
            fw.close()
    return 0


class StepReporter:
    """The ``on_steps`` of ``timed_loop``: rank 0 writes each timed step's event; every rank
    keeps the indices so that ``check_complete`` can assert that every step got its time, in
    order. ``first`` runs once, before the first step's event (a worker that learns something
    for its ``start`` event only from the first step writes it there)."""

    def __init__(self, events: EventWriter, rank: int, measure: Measure, global_batch: int,
                 first: Callable[[], None] | None = None,
                 data_wait: Callable[[int], float | None] = lambda _: None,
                 compiles: Callable[[int], int | None] = lambda _: None) -> None:
        self.events, self.rank, self.measure = events, rank, measure
        self.global_batch = global_batch
        self.first = first
        self.data_wait = data_wait
        self.compiles = compiles
        self.timed: list[int] = []
        self.loop_began_at: float | None = None
        """Unix time when the measured loop began: step 0's time counts from there."""
        self.first_done_at: float | None = None
        """Unix time when step 0 ended: the loop's start plus step 0's own time (not the
        moment its time was read, which in a loop that keeps two steps in flight comes after
        step 1 has run)."""

    def __call__(self, done: StepTimes) -> None:
        if done and self.first_done_at is None:
            index, seconds = done[0]
            if index == 0 and self.loop_began_at is not None:
                self.first_done_at = self.loop_began_at + seconds
            else:
                self.first_done_at = time.time()
        if done and self.first is not None:
            first, self.first = self.first, None
            first()
        self.timed.extend(index for index, _ in done)
        if self.rank == 0:
            for index, seconds in done:
                self.events.emit(Step(index=index, seconds=seconds, samples=self.global_batch,
                                      warmup=index < self.measure.warmup,
                                      data_wait_s=self.data_wait(index),
                                      compiles=self.compiles(index)))

    def check_complete(self) -> None:
        assert self.timed == list(range(self.measure.iters)), \
            "every step must have its time, in order"


def process_start_time() -> float | None:
    """Unix time this process started, from ``/proc``: its start in clock ticks since boot
    (10 ms on Linux) set against the boot-time clock now, so that it is as precise as the tick
    (``btime``, the boot's Unix time, is whole seconds). None where it cannot be read."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # The command name may hold spaces: fields are counted after its closing bracket.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_boot_s = time.clock_gettime(time.CLOCK_BOOTTIME)
        now = time.time()
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return now - (since_boot_s - ticks / os.sysconf("SC_CLK_TCK"))


def launched_at() -> float | None:
    """Unix time the run was launched at: the runner's stamp (``LAUNCHED_AT_ENV``, to the
    microsecond) where it gave one, else this process's own start (``process_start_time``)."""
    text = os.environ.get(LAUNCHED_AT_ENV, "").strip()
    try:
        return float(text) if text else process_start_time()
    except ValueError:
        return process_start_time()


def startup_fields(first_done_at: float | None, compiles_before: int | None,
                   compiles_after: int | None) -> dict[str, Any]:
    """``End``'s start-up figures: seconds from the run's launch to the end of its step 0
    (the launcher, imports, process group, model, data and the mode's compilation), and how
    many times the step compiled again inside the window (None where the framework cannot
    tell)."""
    began = launched_at()
    recompiles = (compiles_after - compiles_before
                  if compiles_before is not None and compiles_after is not None else None)
    return {"startup_s": first_done_at - began if first_done_at and began else None,
            "recompiles_in_window": recompiles}


def memory_fields(per_rank, with_reserved: bool, with_device_used: bool = False) -> dict:
    """The ``end`` event's memory figures from every rank's gathered ``(peak[, reserved][,
    device_used])`` row: the largest over ranks, and each rank's peak. A device-used figure
    below 0 is one a rank could not read (``device_used_bytes``'s None)."""
    peaks = [int(row[0]) for row in per_rank]
    out: dict = {"peak_memory_bytes": max(peaks), "peak_memory_bytes_per_rank": peaks}
    if with_reserved:
        out["peak_reserved_bytes"] = max(int(row[1]) for row in per_rank)
    if with_device_used:
        used = [int(row[2 if with_reserved else 1]) for row in per_rank]
        out["device_used_bytes"] = max(used) if min(used) >= 0 else None
    return out


def cudnn_version(pattern: str) -> int | None:
    """cudnnGetVersion() of the first cuDNN library matching the glob ``pattern`` that loads
    (frameworks ship it inside their wheel or as an ``nvidia-cudnn`` wheel)."""
    import ctypes
    import glob

    for path in sorted(glob.glob(pattern)):
        try:
            lib = ctypes.CDLL(path)
            lib.cudnnGetVersion.restype = ctypes.c_size_t
            return int(lib.cudnnGetVersion())
        except (OSError, AttributeError):
            continue
    return None
