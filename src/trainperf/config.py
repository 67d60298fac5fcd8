"""Typed configuration: what is trained (Workload), where (Topology) and how it is timed (Measure).

Every class checks itself once, on construction, and raises ValueError with a message a user can
act on. Nothing here imports a framework: the runner plans with these objects and hands them to
workers as JSON.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

FC_MODES = ("dp", "mp", "pfc")
PRECISIONS = ("fp32", "fp16", "bf16")
LOSSES = ("arcface", "cosface", "softmax", "combined")
TASKS = ("face", "classification")
PFC_UPDATES = ("sparse", "dense")
DEVICE_KINDS = ("auto", "cuda", "cpu")
MXNET_KVSTORES = ("horovod", "dist_sync", "device")
TF32_MODES = ("on", "off")
TUNING_SETTINGS = ("cudnn_benchmark", "ddp_bucket_mb", "ddp_static_graph", "ddp_broadcast_buffers",
                   "mxnet_kvstore", "tf_onednn", "tf32")
"""The ``Tuning`` fields a framework honours by a switch of its own or refuses
(``Capabilities.tuning``); the layout and the mode are resolved on their own terms."""
SETTING_OWNER = {"mxnet_kvstore": "mxnet", "tf_onednn": "tf"}
"""Settings that name the one framework they are for: the others neither honour nor refuse
them, so that one flag can tune one framework of a comparison."""
GPU_SETTINGS = ("cudnn_benchmark", "tf32")
"""Settings that change nothing on a CPU (no cuDNN, no TF32): a CPU run neither applies nor
refuses them."""


def tuning_flag(name: str, value: object) -> str:
    """A ``TUNING_SETTINGS`` value as the command line spells it (``--no-cudnn-benchmark``)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):  # the command line turns on what is off, and the reverse
        return flag if value else flag.replace("--", "--no-", 1)
    return f"{flag} {value}"
MEMORY_FORMATS = ("auto", "channels_last", "channels_first")
MODE_DEFAULT = "default"
"""``--mode default``: the first mode the framework declares for the device (its fixed default)."""
MODE_BEST = "best"
"""``--mode best``: each of the framework's modes probed briefly, the timed runs in the fastest."""
PFC_DEFAULT_RATIO = 0.1
"""Partial FC's ratio where none is given: DLPerf's and the Partial FC paper's."""

# (m1, m2, m3) of the combined margin cos(m1 * theta + m2) - m3.
MARGINS = {
    "arcface": (1.0, 0.5, 0.0),
    "cosface": (1.0, 0.0, 0.4),
    "softmax": (1.0, 0.0, 0.0),
}


@dataclass(frozen=True)
class Workload:
    """Everything that changes the work done by one training step."""

    backbone: str
    """Registered backbone name, e.g. ``iresnet100`` or ``mobilefacenet_y1``."""
    num_classes: int
    """Number of identities (face) or categories (classification)."""
    batch_size: int
    """Samples per device per step."""
    task: str = "face"
    """``face``: embedding + margin-softmax head; ``classification``: the backbone ends in logits."""
    embedding_size: int = 512
    """Width of the face embedding fed to the classification head."""
    output_block: str = "E"
    """IResNet output block: ``E`` (BN, dropout, FC, BN) or ``FC`` (FC, BN); others ignore it."""
    input_size: int = 112
    """Square input side in pixels."""
    loss: str = "arcface"
    """``arcface``, ``cosface``, ``softmax`` or ``combined`` (then ``margins`` is required)."""
    margins: tuple[float, float, float] | None = None
    """(m1, m2, m3) of cos(m1*theta + m2) - m3; defaults from ``loss``."""
    scale: float = 64.0
    """Logit scale s of the margin softmax."""
    fc: str = "dp"
    """``dp`` replicated class matrix, ``mp`` sharded classes, ``pfc`` sharded and sampled."""
    sample_ratio: float = 1.0
    """Fraction of each rank's class shard that ``pfc`` samples per step."""
    pfc_update: str = "sparse"
    """``sparse``: update only sampled rows (per-row momentum); ``dense``: whole-matrix SGD as
    insightface's arcface_torch does."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast with dynamic loss scaling)."""
    lr: float = 0.1
    """Base learning rate."""
    lr_steps: tuple[int, ...] = ()
    """Steps at which the learning rate changes."""
    lr_scales: tuple[float, ...] = ()
    """Multiplier of the base rate from each ``lr_steps`` entry on."""
    momentum: float = 0.9
    weight_decay: float = 5e-4
    clip_grad_norm: float | None = 5.0
    """Max L2 norm of the backbone gradient (InsightFace clips at 5); None disables."""
    dropout: float = 0.4
    """Dropout in the ``E`` output block (insightface's MXNet ``get_fc1`` uses 0.4)."""
    seed: int = 0
    """Seed of weights and synthetic data (rank r uses seed + r for its data)."""
    channels_last: bool = False
    """Use channels-last memory format for the backbone (GPU speed option)."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.embedding_size < 1:
            raise ValueError(f"embedding_size must be >= 1, got {self.embedding_size}")
        if self.fc not in FC_MODES:
            raise ValueError(f"--fc must be one of {', '.join(FC_MODES)}, got {self.fc!r}")
        if self.task == "classification" and self.fc != "dp":
            raise ValueError("classification workloads support only --fc dp")
        if not (0.0 < self.sample_ratio <= 1.0):
            raise ValueError(f"--sample-ratio must be in (0, 1], got {self.sample_ratio}")
        if self.sample_ratio < 1.0 and self.fc != "pfc":
            raise ValueError("--sample-ratio below 1 needs --fc pfc")
        if self.pfc_update not in PFC_UPDATES:
            raise ValueError(f"pfc_update must be one of {PFC_UPDATES}, got {self.pfc_update!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.loss == "combined" and self.margins is None:
            raise ValueError("loss 'combined' needs margins=(m1, m2, m3)")
        m1, m2, m3 = self.resolved_margins
        if m1 <= 0 or not (0 <= m2 < math.pi) or m3 < 0:
            raise ValueError(f"margins need m1 > 0, 0 <= m2 < pi, m3 >= 0; got {(m1, m2, m3)}")
        if self.scale <= 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")
        if len(self.lr_steps) != len(self.lr_scales):
            raise ValueError("lr_steps and lr_scales must have the same length")
        if list(self.lr_steps) != sorted(self.lr_steps):
            raise ValueError("lr_steps must be increasing")
        if self.input_size < 16:
            raise ValueError(f"input_size must be >= 16, got {self.input_size}")

    @property
    def resolved_margins(self) -> tuple[float, float, float]:
        if self.margins is not None:
            return tuple(float(m) for m in self.margins)  # type: ignore[return-value]
        return MARGINS.get(self.loss, MARGINS["softmax"])

    def lr_at(self, step: int) -> float:
        """Learning rate for a 0-based optimizer step (piecewise constant, as InsightFace)."""
        rate = self.lr
        for boundary, factor in zip(self.lr_steps, self.lr_scales):
            if step >= boundary:
                rate = self.lr * factor
        return rate

    def replace(self, **changes: Any) -> "Workload":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["margins"] = list(self.resolved_margins)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Workload":
        d = dict(d)
        for key in ("margins", "lr_steps", "lr_scales"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return _from_dict(cls, d, "workload")


@dataclass(frozen=True)
class Tuning:
    """Backend speed settings. They change how fast a step runs, never what it computes, and the
    results record them beside the measured figures."""

    cudnn_benchmark: bool = True
    """GPU: let cuDNN time its algorithms for each input shape and keep the fastest, as
    insightface's arcface_torch, timm's benchmark and MXNet (by default) do. Ignored on CPU."""
    ddp_bucket_mb: float = 25.0
    """Size of DDP's gradient buckets in MiB: smaller ones start their all-reduce earlier in the
    backward, larger ones make fewer calls. 25 is torch's default; arcface_torch uses 16."""
    ddp_static_graph: bool = True
    """Tell DDP that every step uses the same parameters in the same order, so after the first
    step it can schedule bucket all-reduces without searching the graph (as arcface_torch)."""
    ddp_broadcast_buffers: bool = False
    """Re-send rank 0's buffers (BatchNorm running statistics) to every rank before each forward.
    Off, as in arcface_torch: training-mode BatchNorm uses batch statistics, so the running ones
    change no step; they only stay per rank, as without SyncBN."""

    mxnet_kvstore: str = "horovod"
    """How MXNet's ranks talk: ``horovod``, one process per rank whose collectives are
    Horovod's (NCCL on GPUs, gloo on a CPU; as the seeds' MXNet ran), ``dist_sync``, one
    process per rank with MXNet's own parameter server (every gradient goes through a CPU
    server process on each node: on many GPUs that measures the server), or ``device``, one
    process driving every device of one node (as insightface's MXNet ArcFace and gluon-cv
    ran). The same arithmetic."""

    tf_onednn: bool = False
    """TensorFlow's oneDNN custom CPU ops (``TF_ENABLE_ONEDNN_OPTS``), off unless asked for.
    On CPUs with AVX-512, the oneDNN in TensorFlow 2.21 writes past a buffer in the backward of
    a 1x1 stride-2 convolution (the weight gradient, NHWC) whose input has fewer than 16
    channels: the heap is corrupted and the run dies of SIGSEGV or SIGABRT, or goes on with
    wrong weight gradients. Off, TensorFlow runs its own Eigen kernels for those ops. Only
    TensorFlow's CPU kernels change; its GPU kernels are the same either way."""

    mode: str = MODE_DEFAULT
    """How the framework executes the step, in its own terms (``eager``, ``compile``, ``graph``,
    ``static``, ``hybrid``, ``xla``, ``jit``: ``Capabilities.modes``), ``default`` (the first
    it declares for the device) or ``best`` (the runner probes every mode and times the
    fastest). A worker is only ever given a mode its framework declares."""

    memory_format: str = "auto"
    """The backbones' layout asked for: ``auto`` (each framework's default on the device,
    ``Capabilities.layouts``), ``channels_last`` or ``channels_first``. What ran is the
    workload's ``channels_last``, resolved per framework when the plans are made."""

    tf32: str = "on"
    """GPU fp32 work on Ampere and later, one rule for every framework: ``on`` runs fp32
    convolutions and matrix products in TF32 wherever the device has TF32 units (what
    TensorFlow, JAX, Paddle, MXNet's cuDNN and OneFlow do by default, and what torch does once
    both its flags are set), ``off`` runs both in full fp32 (what a comparison with a CPU run
    needs). Each framework sets it with its own switch and records what ran
    (``tf32_cudnn``, ``tf32_matmul``, ``tf32_switch``); MFU counts each engine at the peak of
    the format it ran in."""

    def __post_init__(self) -> None:
        if self.tf32 not in TF32_MODES:
            raise ValueError(f"--tf32 must be one of {', '.join(TF32_MODES)}, got {self.tf32!r}")
        if self.memory_format not in MEMORY_FORMATS:
            raise ValueError(f"--memory-format must be one of {', '.join(MEMORY_FORMATS)}, "
                             f"got {self.memory_format!r}")
        if not self.mode or not self.mode.replace("-", "").isalnum():
            raise ValueError(f"--mode takes a mode's name, got {self.mode!r}")
        if not self.ddp_bucket_mb > 0:
            raise ValueError(f"--ddp-bucket-mb must be > 0, got {self.ddp_bucket_mb}")
        if self.mxnet_kvstore not in MXNET_KVSTORES:
            raise ValueError(f"--mxnet-kvstore must be one of {', '.join(MXNET_KVSTORES)}, "
                             f"got {self.mxnet_kvstore!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Tuning":
        return _from_dict(cls, d, "tuning")


LOADER_PYTHON_ENV = "TRAINPERF_LOADER_PYTHON"
"""The interpreter real-data loader processes run (set by the runner: its own, which has the
decoders); where unset, the worker's."""
LOCAL_WORLD_ENV = "TRAINPERF_LOCAL_WORLD"
"""Ranks on this node (set by the runner): their loader processes share its cores."""


@dataclass(frozen=True)
class DataSpec:
    """Real data: a RecordIO dataset fed through the input pipeline instead of synthetic
    tensors. None of it changes what a step computes; it changes where the batches come from."""

    prefix: str
    """``PREFIX.rec`` and ``PREFIX.idx`` (insightface's face layout or im2rec's flat one)."""
    decoder: str = "auto"
    """JPEG decoder of the loader processes (``trainperf.data.decode``); ``auto``: the fastest
    installed."""
    loader_workers: int | None = None
    """Loader processes per rank; None: the host's cores per rank less one, 1 to 8."""
    prefetch_batches: int = 4
    """Batches each loader process keeps ready."""

    def __post_init__(self) -> None:
        if self.loader_workers is not None and self.loader_workers < 0:
            raise ValueError(f"--loader-workers must be >= 0, got {self.loader_workers}")
        if self.prefetch_batches < 1:
            raise ValueError(f"prefetch_batches must be >= 1, got {self.prefetch_batches}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DataSpec":
        return _from_dict(cls, d, "data")


@dataclass(frozen=True)
class TrainSpec:
    """Training to a verification accuracy (``trainperf train``): when to evaluate, when to stop
    and where the checkpoints go. The steps themselves are the workload's."""

    val: tuple[str, ...]
    """Verification sets (insightface ``.bin``); the first decides whether the target is met."""
    target: float
    """Accuracy (a fraction, 10-fold mean) on the first set that ends the run."""
    max_steps: int
    """Optimizer steps after which the run stops whether or not it met the target."""
    eval_every: int
    """Steps between evaluations; time to target is known to this resolution."""
    checkpoint_every: int | None = None
    """Steps between checkpoints (None: at every evaluation)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; a run that finds one there resumes from the newest."""
    keep_checkpoints: int = 2
    """Checkpoints kept; older ones are deleted once a newer one is complete."""
    eval_batch_size: int = 64
    """Images per forward pass of the evaluation (each image and its flip)."""
    far: float = 1e-3
    """False-accept rate at which the true-accept rate (TAR) is reported."""

    def __post_init__(self) -> None:
        if not self.val:
            raise ValueError("--val needs at least one verification set (.bin)")
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"--target is an accuracy in (0, 1] (or a percentage like 95%), "
                             f"got {self.target}")
        if self.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.max_steps}")
        if self.eval_every < 1:
            raise ValueError(f"--eval-every must be >= 1, got {self.eval_every}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1, got {self.eval_batch_size}")
        if not 0.0 < self.far < 1.0:
            raise ValueError(f"far must be in (0, 1), got {self.far}")

    @property
    def save_every(self) -> int:
        return self.checkpoint_every or self.eval_every

    def replace(self, **changes: Any) -> "TrainSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["val"] = list(self.val)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainSpec":
        d = dict(d)
        d["val"] = tuple(d.get("val") or ())
        return _from_dict(cls, d, "train")


ALIGN_DTYPES = ("float64", "float32")
RULE_BREAKS = ("margin_straight_through",)
"""Rule changes an alignment run makes on purpose (``AlignSpec.breaks``), for the negative
controls that only a worker's code can make: ``margin_straight_through`` passes the margin's
gradient to the cosine unchanged (derivative 1), as insightface's arcface_torch does. The other
controls (weight decay, momentum, clipping, the rate schedule) change the candidate's workload."""


@dataclass(frozen=True)
class AlignSpec:
    """A strict alignment run (``trainperf.align``): where its start is, what it computes in and
    where it writes what it did after every step."""

    start: str
    """An ``.npz`` of initial weights and per-rank batches that the worker loads instead of
    drawing its own. Layout: ``backbone/<torch state_dict name>`` (torch layouts: OIHW
    convolutions, [out, in] linear weights, BatchNorm ``weight``/``bias``/``running_mean``/
    ``running_var``), ``head/weight`` (the whole class matrix [classes, embedding]; a sharded
    head takes its rows), ``images/<rank>`` (float32 NCHW) and ``labels/<rank>`` (int64)."""
    dtype: str = "float32"
    """What the parameters, activations, gradients and optimizer state are held and computed
    in: ``float64`` (rounding far below any difference of rule) or ``float32``."""
    dump: str | None = None
    """A folder: after step i every rank writes ``step-<i>-rank-<r>.npz`` there
    (``trainperf.backends.workerkit.write_dump``): its parameters and BatchNorm statistics in
    torch's names and layouts, its loss, its gradient norm before clipping and its rate."""
    breaks: tuple[str, ...] = ()
    """Rules broken on purpose (``RULE_BREAKS``): negative controls only."""

    def __post_init__(self) -> None:
        if self.dtype not in ALIGN_DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(ALIGN_DTYPES)}, "
                             f"got {self.dtype!r}")
        unknown = [b for b in self.breaks if b not in RULE_BREAKS]
        if unknown:
            raise ValueError(f"unknown rule break(s) {unknown}; known: {', '.join(RULE_BREAKS)}")

    def breaks_rule(self, rule: str) -> bool:
        return rule in self.breaks

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["breaks"] = list(self.breaks)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AlignSpec":
        d = dict(d)
        d["breaks"] = tuple(d.get("breaks") or ())
        return _from_dict(cls, d, "align")


def parse_accuracy(text: str) -> float:
    """``0.95`` or ``95%`` as the fraction 0.95."""
    s = text.strip()
    try:
        value = float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError:
        raise ValueError(f"--target takes an accuracy like 0.95 or 95%, got {text!r}") from None
    if value > 1.0:
        raise ValueError(f"--target {text!r} is above 1: write a fraction (0.95) or a "
                         f"percentage with its sign (95%)")
    return value


@dataclass(frozen=True)
class Topology:
    """Where a run executes: nodes, processes per node and the rendezvous point."""

    devices_per_node: int = 1
    """Processes per node: one per GPU, or CPU processes on gloo."""
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    device: str = "auto"
    """``auto`` picks cuda when available, else cpu."""
    rdzv: str | None = None
    """``HOST:PORT`` where the nodes meet and get their ranks (``trainperf.rendezvous``); None: the
    node rank and master address are given by hand."""
    rdzv_timeout_s: float = 300.0
    """How long a node waits for the others: at each meeting, and in a collective whose peer
    vanished without closing its connections."""

    def __post_init__(self) -> None:
        if self.rdzv is not None:
            if self.nnodes < 2:
                raise ValueError("--rdzv is for several nodes: give --nnodes N (N > 1) too")
            if self.node_rank != 0:
                raise ValueError("--rdzv assigns node ranks; drop --node-rank")
        if not self.rdzv_timeout_s > 0:
            raise ValueError(f"--rdzv-timeout must be > 0 seconds, got {self.rdzv_timeout_s}")
        if self.devices_per_node < 1:
            raise ValueError(f"--devices must be >= 1, got {self.devices_per_node}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not (0 <= self.node_rank < self.nnodes):
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not (0 < self.master_port < 65536):
            raise ValueError(f"--master-port must be a TCP port, got {self.master_port}")
        if self.device not in DEVICE_KINDS:
            raise ValueError(f"--device must be one of {', '.join(DEVICE_KINDS)}, got {self.device!r}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.devices_per_node


STALL_FLOOR_S = 300.0
"""The least a sized stall limit is (``Measure.stall_floor_s``), and all it is until a step of
the case is known: long enough for a framework that compiles at its second or third step. The
longest compilation recorded under ``benchmarks/results`` is 103.5 s (``compile_s``: JAX's jit
of IResNet-100 on the CPU, ``modes-cpu/runs/jax-r100``; torch.compile of IResNet-50 took
89.4 s there): the floor is about three times it."""


@dataclass(frozen=True)
class Measure:
    """How runs are timed (DLPerf: 5 runs of 120 iterations, the first 20 skipped)."""

    runs: int = 5
    iters: int = 120
    warmup: int = 20
    timeout_s: float = 1800.0
    """Wall-clock limit of one run; past it every process of the run is killed."""
    stall_timeout_s: float | None = None
    """A run that has reported its first step and then reports nothing more for this long is
    stopped as hung, whatever is left of ``timeout_s`` (None: sized from the case's step times,
    ``trainperf.stall``, unless ``stall_auto`` is off)."""
    stall_auto: bool = True
    """Where no ``stall_timeout_s`` is fixed, size a stall limit from the case's step times
    (``stall.limit_s``); False: only ``timeout_s`` (``--stall-timeout off``)."""
    stall_floor_s: float = STALL_FLOOR_S
    """The least a sized stall limit is, and all it is until a step of the case is known."""
    memory_limit_bytes: int | None = None
    """Per-process cap of the data segment (RLIMIT_DATA) for CPU runs (None: no cap)."""
    threads: int | None = None
    """Intra-op threads per process on CPU (None: the node's cores shared out among its
    processes)."""

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise ValueError(f"--runs must be >= 1, got {self.runs}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.iters <= self.warmup:
            raise ValueError(
                f"--iters ({self.iters}) must exceed --warmup ({self.warmup}) to leave steps to time"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout_s}")
        if self.stall_timeout_s is not None and self.stall_timeout_s <= 0:
            raise ValueError(f"--stall-timeout must be > 0, got {self.stall_timeout_s}")
        if self.stall_timeout_s is not None and not self.stall_auto:
            raise ValueError("a fixed --stall-timeout and --stall-timeout off at once")
        if self.stall_floor_s <= 0:
            raise ValueError(f"--stall-floor must be > 0, got {self.stall_floor_s}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")

    @property
    def window_steps(self) -> int:
        return self.iters - self.warmup

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        # Folders measured before these fields existed resume as before: a field at its
        # default is left out (a folder without them now runs under the sized stall limit,
        # and each run records the limit it ran under).
        for key, default in (("stall_timeout_s", None), ("stall_auto", True),
                             ("stall_floor_s", STALL_FLOOR_S)):
            if d[key] == default:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Measure":
        return _from_dict(cls, d, "measure")


@dataclass(frozen=True)
class ProfileSpec:
    """A profiled run (``run --breakdown`` / ``--trace``): after a case's timed runs, one more
    run whose steps are split into phases (``trainperf.backends.phases``). It is never one of
    the runs that the statistics are taken over."""

    steps: int = 10
    """Profiled steps, after ``Measure.warmup`` unprofiled ones."""
    trace_dir: str | None = None
    """Where the framework's own trace of the profiled steps goes (None: no trace)."""

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"a breakdown needs at least 2 profiled steps, got {self.steps}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProfileSpec":
        return _from_dict(cls, d, "profile")


def _from_dict(cls, d: dict[str, Any], what: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown {what} fields: {sorted(unknown)}")
    return cls(**d)


def parse_int_list(text: str, what: str) -> list[int]:
    """Parse ``1,2,4`` into [1, 2, 4]; ValueError names the flag on bad input."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{what} takes comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{what} needs at least one value")
    return values


def parse_list(text: str) -> list[str]:
    """``a, b,c`` as ["a", "b", "c"]: the items of a comma-separated flag, blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_bytes(text: str) -> int:
    """Parse ``8GiB``, ``512MiB``, ``2GB`` or a plain byte count."""
    units = {
        "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
        "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1, "": 1,
    }
    s = text.strip().lower()
    number = s.rstrip("kmgtib")
    unit = s[len(number):]
    if unit not in units:
        raise ValueError(f"unknown size unit in {text!r} (use B, KiB, MiB, GiB, KB, MB, GB)")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"cannot read a size from {text!r}") from None
    if value <= 0:
        raise ValueError(f"size must be > 0, got {text!r}")
    return int(value * units[unit])


__all__ = [
    "Workload", "Tuning", "DataSpec", "TrainSpec", "AlignSpec", "ProfileSpec", "Topology", "Measure", "FC_MODES",
    "PRECISIONS", "MARGINS", "parse_int_list", "parse_list", "parse_bytes", "parse_accuracy",
]
