"""The contract between the runner and a worker, version ``trainperf.protocol/v1``.

This module is the whole contract: a worker written for any framework follows it from this text
alone. It imports only the standard library and ``trainperf.config`` (which imports nothing
else), so a framework's environment can import it without torch.

How a run goes
--------------
1. The runner writes a **spec** (a JSON object, :class:`RunSpec`) to a file and starts the run's
   process tree: one process per rank, each given ``--spec SPEC_PATH --events EVENTS_PATH``.
   How ranks find each other is the backend's launch business (the torch backend's ranks get
   the variables ``torch.distributed.run`` would set); a rank learns its rank and the world
   size from that launch.
2. Workers append **events** to ``EVENTS_PATH``: one JSON object per line, each line written with
   one ``write`` to a file opened in append mode, so lines of several ranks never interleave.
   Every event has ``event`` (its kind), ``rank`` (global rank of the writer) and ``t`` (Unix
   time in seconds when written). Kinds, in the order rank 0 writes them:

   - ``start`` (:class:`Start`, rank 0, once, before the first step): what runs, where, and what
     the worker predicts about it.
   - ``step`` (:class:`Step`, rank 0, one per optimizer step, warm-up steps included, in step
     order, written as soon as the step's time is known): ``index`` (0-based), ``seconds``,
     ``samples`` (global samples of the step), ``warmup`` (``index < measure.warmup``); with
     real data (``spec.data``) also ``data_wait_s``, the host seconds it waited for its batch;
     where the framework counts its compilations, ``compiles``, the count once the step was
     issued (a mode probe's timed steps start where it stops moving).
   - ``eval`` (:class:`Eval`, rank 0, training runs only, after every evaluation): the
     verification accuracies and how long the run has trained so far.
   - ``phases`` (:class:`Phases`, rank 0, once, profiled runs only, before ``end``): the
     profiled steps split into phases (see "Profiled runs").
   - ``end`` (:class:`End`, rank 0, once, after the last step): the window's figures.
   - ``error`` (:class:`Error`, any rank, when it fails): ``kind`` is ``oom`` for an
     out-of-memory, else ``exception``; ``message`` one line; ``traceback`` a list of lines.

3. Every process exits; 0 means it finished cleanly. Before a launcher stops a hung run it may
   send each live worker ``SIGUSR1``: a worker answers by writing every thread's Python stack
   to its stderr (``faulthandler.register``), which tells where each rank was. The **launcher**
   (not a worker) then appends one ``exit`` event per process it started (:class:`Exit`): how
   the process ended, whether the launcher stopped it (and whether it was suspended then), and
   the file that holds its output. A launcher gives every process its own output file, so that
   a crash is told by the lines of the process that crashed.

Timing rules every worker follows
---------------------------------
- Run ``measure.iters`` optimizer steps; the first ``measure.warmup`` (compilation, autotuning,
  allocator growth) are outside the window.
- At the window's start, wait for the device to finish and meet every rank at a barrier; at its
  end, wait for the device once more. Between the edges: no host read-back, no sync (the
  framework's own sync at the edges only: ``torch.cuda.synchronize``, ``mx.nd.waitall()``, ...).
- ``End.samples_per_s`` = global samples of the window's steps / wall seconds of the window.
  Never a mean of per-step rates, never rank 0's rate times the world size.
- Per-step ``seconds`` come from device events where the device runs asynchronously, else from
  the host clock. Every step of the window has its ``step`` event by the time ``end`` is written.

Training to accuracy
--------------------
A spec with ``train`` (``trainperf.config.TrainSpec``) asks the worker to train on ``data``
until the first verification set's 10-fold accuracy reaches ``train.target`` or
``train.max_steps`` steps are done. It evaluates every ``eval_every`` steps (and after the
last), writing an ``eval`` event each time; ``step`` events and the timing rules stay as above,
except that the device is also synchronised around each evaluation and checkpoint, which are
outside every step's time. ``end`` then carries ``train``: the outcome and the whole curve.
Training time is the sum of the step times, over every attempt of a resumed run.

Profiled runs
-------------
A spec with ``profile`` (``trainperf.config.ProfileSpec``) asks for ``measure.warmup`` steps as
usual, then ``profile.steps`` steps split into phases (``trainperf.backends.phases``), each
phase closed by a device fence or a device event, inside the framework's own profiler. Its
``step`` events carry the profiled steps' times; rank 0 writes one ``phases`` event
(:class:`Phases`) before ``end``. The runner keeps such a run apart from the timed runs: the
fences change the step, so its rate is never a result.

Status
------
The runner alone decides a run's status, from the events and how the processes ended: ``oom``
if any rank wrote an ``oom`` error; ``timeout`` if the run passed ``--timeout`` (or went
``--stall-timeout`` without a step after its first) and was killed, or if a process was found
suspended (``Exit.suspended``) when the run's processes were stopped, whichever timeout
stopped them, the runner's or a framework's collective;
``failed`` if a process died of a signal that its launcher did not send, or exited non-zero
without writing an ``error`` (a native crash, the kernel's out-of-memory killer), even after
``end``: a process that corrupted its memory may have done so inside the window (under a
memory cap, ``measure.memory_limit_bytes``, a death by SIGSEGV, SIGBUS or SIGABRT is ``oom``:
native code that does not check an allocation the cap refused crashes); ``ok`` if
``end`` was written (an exception raised while shutting down after it is kept as a warning);
otherwise ``failed``. On several nodes, a process that died on any node fails the run on every
node. A worker never writes a status.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import traceback
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .config import AlignSpec, DataSpec, Measure, ProfileSpec, TrainSpec, Tuning, Workload

PROTOCOL = "trainperf.protocol/v1"
LAUNCHED_AT_ENV = "TRAINPERF_LAUNCHED_AT"
"""Unix time (s, as ``time.time()``) at which the runner started the run's launcher: where a
run's ``End.startup_s`` counts from. Every process of the run inherits it."""
ERROR_KINDS = ("oom", "exception")


class ProtocolError(ValueError):
    """A spec or an event that does not follow this contract."""


@dataclass(frozen=True)
class RunSpec:
    """What the runner asks one run to do (the ``--spec`` file)."""

    workload: Workload
    """Every setting that changes the work (``trainperf.config.Workload``)."""
    measure: Measure
    """Iterations, warm-up, memory limit (``trainperf.config.Measure``)."""
    tuning: Tuning = field(default_factory=Tuning)
    """Speed settings that change no result (``trainperf.config.Tuning``)."""
    device: str = "auto"
    """``auto``, ``cuda`` or ``cpu``."""
    threads: int | None = None
    """Intra-op threads per process on CPU (None: the framework's default)."""
    align: AlignSpec | None = None
    """A strict alignment run (``trainperf.align``): its start file, its dtype and where it
    writes each step's state (``trainperf.config.AlignSpec``); None: a throughput run."""
    data: DataSpec | None = None
    """Real data (``trainperf.config.DataSpec``): batches come from a RecordIO file through
    the input pipeline; None: synthetic tensors made on the device once. With real data every
    ``step`` event carries ``data_wait_s``."""
    train: TrainSpec | None = None
    """Train to a verification accuracy (see "Training to accuracy"); None: a throughput run."""
    profile: ProfileSpec | None = None
    """A profiled run (see "Profiled runs"); None: a timed run."""
    protocol: str = PROTOCOL

    def to_dict(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "workload": self.workload.to_dict(),
                "measure": self.measure.to_dict(), "tuning": self.tuning.to_dict(),
                "device": self.device, "threads": self.threads,
                "align": self.align.to_dict() if self.align else None,
                "data": self.data.to_dict() if self.data else None,
                "train": self.train.to_dict() if self.train else None,
                "profile": self.profile.to_dict() if self.profile else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunSpec":
        if not isinstance(d, dict):
            raise ProtocolError(f"a spec is a JSON object, got {type(d).__name__}")
        if d.get("protocol") != PROTOCOL:
            raise ProtocolError(f"spec speaks {d.get('protocol')!r}; this worker speaks "
                                f"{PROTOCOL!r}")
        try:
            return cls(Workload.from_dict(d["workload"]), Measure.from_dict(d["measure"]),
                       Tuning.from_dict(d.get("tuning", {})), d.get("device", "auto"),
                       d.get("threads"),
                       AlignSpec.from_dict(d["align"]) if d.get("align") else None,
                       DataSpec.from_dict(d["data"]) if d.get("data") else None,
                       TrainSpec.from_dict(d["train"]) if d.get("train") else None,
                       ProfileSpec.from_dict(d["profile"]) if d.get("profile") else None)
        except KeyError as exc:
            raise ProtocolError(f"spec lacks {exc.args[0]!r}") from None

    @classmethod
    def load(cls, path: str) -> "RunSpec":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


@dataclass(kw_only=True)
class Event:
    KIND: ClassVar[str] = ""
    rank: int = 0
    """Global rank of the process that wrote the event."""
    t: float = 0.0
    """Unix time (s) when the event was written."""

    def to_dict(self) -> dict[str, Any]:
        # Shallow on purpose: a step event is written every step, and JSON needs no copies.
        return {"event": self.KIND,
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}


@dataclass(kw_only=True)
class Start(Event):
    """Written by rank 0 before the first step."""

    KIND: ClassVar[str] = "start"
    world_size: int
    global_batch: int
    """Samples per step over all ranks."""
    device: str
    """The device rank 0 runs on, e.g. ``cuda:0`` or ``cpu``."""
    env: dict[str, Any]
    """What only the framework knows: ``framework``, ``framework_version``, ``device_names``,
    CUDA / cuDNN / NCCL versions, ``cudnn_benchmark``, TF32 flags, thread counts."""
    workload: dict[str, Any]
    """The workload as the worker understood it (``Workload.to_dict()``)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Speed settings in effect: ``cudnn_benchmark``, ``ddp`` (DDP's arguments, None in one
    process), ``loss_scaling``..."""
    backbone_params: int | None = None
    train_flops_per_sample: float | None = None
    """Forward + backward FLOPs of one sample (a multiply-add is 2 FLOPs)."""
    train_flops_by_op: dict[str, float] | None = None
    """The same split by the engine that runs it: ``conv`` (cuDNN) and ``matmul`` (cuBLAS);
    MFU weighs each by the peak it ran at."""
    pfc_update: str | None = None
    """``full``, ``sparse`` or ``dense``: which class-matrix update ran."""
    baseline_memory_bytes: int | None = None
    """Memory in use before the model was built."""
    predicted_peak_bytes: int | None = None
    memory_model: dict[str, Any] | None = None


@dataclass(kw_only=True)
class Step(Event):
    """Written by rank 0 for every step, in order."""

    KIND: ClassVar[str] = "step"
    index: int
    seconds: float
    samples: int
    warmup: bool
    data_wait_s: float | None = None
    """Real data: host seconds this step waited for its batch from the input pipeline."""
    compiles: int | None = None
    """How many times the run's mode had compiled or traced its step once this step was issued
    (``FrameworkRun.compile_count``); None where the framework cannot tell. Where it stops
    moving, compilation is over: a mode probe's timed steps start there."""


@dataclass(kw_only=True)
class End(Event):
    """Written by rank 0 after the last step."""

    KIND: ClassVar[str] = "end"
    samples_per_s: float
    window_s: float
    window_samples: int
    window_steps: int
    loss_first: float
    loss_last: float
    losses: list[float] | None = None
    """Every step's loss on rank 0, warm-up included (what alignment compares)."""
    nonfinite_losses: int = 0
    """Steps (of all ``iters``) whose loss was NaN or infinite."""
    skipped_steps_in_window: int = 0
    """Window steps whose update was skipped (fp16 overflow): their time holds no update."""
    final_loss_scale: float | None = None
    startup_s: float | None = None
    """Seconds from the run's launch to the end of rank 0's step 0 (the measured loop's start
    plus step 0's own time, never the moment its time was read): the launcher, imports,
    process group, model, batches and the mode's compilation. The launch is the time the runner
    gives in ``LAUNCHED_AT_ENV``; a process started without it counts from its own start, read
    from ``/proc`` (to the kernel's clock tick, 10 ms)."""
    compile_s: float | None = None
    """Seconds rank 0's framework spent compiling the step over the whole run, timed where it
    compiles (``FrameworkRun.compile_seconds``: JAX's lower and compile, TorchDynamo and
    inductor, TensorFlow's tracing and XLA, Paddle's program build, OneFlow's graph compile,
    MXNet's cached-graph build); 0.0 in a mode that compiles nothing; None where the framework
    cannot tell."""
    compile_measure: str | None = None
    """What ``compile_s`` timed, in the framework's own terms (one line)."""
    recompiles_in_window: int | None = None
    """Times the step compiled or traced again inside the window (a changed shape, a failed
    guard); None where the framework cannot tell."""
    peak_memory_bytes: int | None = None
    """Largest peak over ranks, of the kind ``Start.env["memory_kind"]`` names: the
    framework allocator's peak, device-wide used memory where the framework keeps no peak, or
    the resident set on a CPU."""
    device_used_bytes: int | None = None
    """On a GPU: the largest device-wide used memory (total - free, every process's) over
    ranks at the end of the run, read from the CUDA driver; None on a CPU or where a rank
    could not read it."""
    peak_reserved_bytes: int | None = None
    window_peak_memory_bytes: int | None = None
    """torch on a GPU: the largest allocated peak over ranks within the window alone."""
    peak_memory_bytes_per_rank: list[int] | None = None
    baseline_memory_bytes: int | None = None
    data_wait_s_per_rank: list[float] | None = None
    """Real data: each rank's seconds waiting for batches inside the window."""
    train: dict[str, Any] | None = None
    """Training runs: ``stopped_by`` (``target`` or ``max_steps``), ``steps``, ``train_s``,
    ``time_to_target_s``, ``steps_to_target``, ``samples_to_target`` (None when not reached),
    ``resumed_from_steps`` and ``curve`` (every ``eval`` event's figures, in order)."""

    @classmethod
    def of_window(cls, window_s: float, measure: Measure, global_batch: int,
                  losses: list[float], skipped_steps: list[int], **extra: Any) -> "End":
        """The end event of a finished loop: the window's rate by the rule above, from every
        step's loss and the indices of the steps whose update was skipped."""
        samples = measure.window_steps * global_batch
        return cls(samples_per_s=samples / window_s, window_s=window_s, window_samples=samples,
                   window_steps=measure.window_steps, loss_first=losses[0],
                   loss_last=losses[-1], losses=losses,
                   nonfinite_losses=sum(not math.isfinite(v) for v in losses),
                   skipped_steps_in_window=sum(i >= measure.warmup for i in skipped_steps),
                   **extra)


@dataclass(kw_only=True)
class Phases(Event):
    """Written by rank 0 of a profiled run, before ``end``."""

    KIND: ClassVar[str] = "phases"
    method: str
    """How the phases were told apart (the framework's profiler, fences, device events)."""
    steps: list[dict[str, Any]]
    """Every profiled step: ``seconds`` (the whole step), ``phases`` ({phase: seconds}, in the
    order they ran) and ``variant`` (``""``; ``no_comm`` for a step run without the gradient
    all-reduce, which tells how much of it the backward hides)."""
    merged: dict[str, str] = field(default_factory=dict)
    """{phase name joining several with ``+``: why the framework cannot split them}."""
    head_has_backward: bool | None = None
    """Whether ``head`` holds the head's backward (else ``backward`` does); None: no head."""
    matmul_flops_per_s: float | None = None
    """The framework's own square GEMM on this device, in the run's precision."""
    matmul_what: str | None = None
    collectives: dict[str, list[str]] | None = None
    """{phase: the collectives the framework's profiler saw inside it}, where it tells."""
    trace: str | None = None
    """The framework's trace of the profiled steps (``profile.trace_dir``)."""
    trace_open: str | None = None
    """How to open ``trace``."""


@dataclass(kw_only=True)
class Eval(Event):
    """Written by rank 0 of a training run after each evaluation."""

    KIND: ClassVar[str] = "eval"
    step: int
    """Optimizer steps done when evaluated."""
    samples: int
    """Global samples trained on so far."""
    train_s: float
    """Seconds of training so far (the sum of step times, every attempt of the run)."""
    eval_s: float
    """Seconds this evaluation took (not part of ``train_s``)."""
    sets: dict[str, Any]
    """Per verification set: ``pairs``, ``accuracy``, ``accuracy_std``, ``tar``, ``far``."""
    accuracy: float
    """The first set's accuracy: what the target is compared with."""
    reached: bool
    """Whether ``accuracy`` met the target at this evaluation."""
    loss: float | None = None
    """Mean training loss (rank 0) of the steps since the previous evaluation."""


@dataclass(kw_only=True)
class Error(Event):
    """Written by any rank that fails."""

    KIND: ClassVar[str] = "error"
    kind: str
    message: str
    traceback: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in ERROR_KINDS:
            raise ProtocolError(f"error kind must be one of {ERROR_KINDS}, got {self.kind!r}")

    @classmethod
    def of_exception(cls, exc: BaseException, oom: bool) -> "Error":
        """The event of the exception being handled (call it inside ``except``)."""
        return cls(kind="oom" if oom else "exception",
                   message=f"{type(exc).__name__}: {exc}"[:2000],
                   traceback=traceback.format_exc().strip().splitlines()[-12:])

    @property
    def exit_code(self) -> int:
        """What the failed process exits with: 3 for an out-of-memory, 1 otherwise."""
        return 3 if self.kind == "oom" else 1


@dataclass(kw_only=True)
class Exit(Event):
    """Written by the launcher when one process of the run has ended (``rank``: the global
    rank of that process, -1 for a helper such as a parameter server)."""

    KIND: ClassVar[str] = "exit"
    returncode: int
    """As Python's ``subprocess`` gives it: 0 clean, N > 0 the exit code, -N killed by signal
    N."""
    stopped: bool = False
    """The launcher stopped it (SIGTERM, then SIGKILL): another process had failed first, or
    the launcher itself was stopped."""
    process: str = ""
    """What the process was, where not a rank: ``scheduler``, ``server on node 1``."""
    log: str | None = None
    """The file that holds the process's stdout and stderr."""
    suspended: bool = False
    """When the launcher came to stop it, the process was suspended (stopped by SIGSTOP or a
    debugger), so it had not run since."""
    stack_dumped: bool = False
    """Before stopping it the launcher asked it to write every thread's Python stack into
    ``log`` (a hung run)."""

    @property
    def name(self) -> str:
        return self.process or f"rank {self.rank}"


EVENT_TYPES: dict[str, type[Event]] = {c.KIND: c
                                       for c in (Start, Step, Phases, Eval, End, Error, Exit)}


def _type_ok(value: Any, hint: Any) -> bool:
    """A shallow check of a JSON value against a field's annotation."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or hint)


def decode(obj: dict[str, Any]) -> Event:
    """The typed event of one decoded JSON line. Fields this version does not know are ignored
    (a later v1 worker may add some); a missing or ill-typed field is a ProtocolError."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"an event is a JSON object, got {type(obj).__name__}")
    cls = EVENT_TYPES.get(obj.get("event"))
    if cls is None:
        raise ProtocolError(f"unknown event {obj.get('event')!r}")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in obj:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{cls.KIND} event lacks {f.name!r}")
            continue
        if not _type_ok(obj[f.name], hints[f.name]):
            raise ProtocolError(f"{cls.KIND} event field {f.name!r} is not "
                                f"{hints[f.name]}: {obj[f.name]!r}")
        values[f.name] = obj[f.name]
    return cls(**values)


def encode(event: Event) -> str:
    """One JSON line (without the newline)."""
    return json.dumps(event.to_dict())


class EventWriter:
    """Appends a rank's events to the events file."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank

    def emit(self, event: Event) -> None:
        event.rank = self.rank
        event.t = time.time()
        # Append mode and one write per line: lines from several ranks never interleave.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(encode(event) + "\n")
