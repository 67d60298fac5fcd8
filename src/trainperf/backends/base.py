"""What a backend is: a small description the runner launches any framework through.

Everything here is the standard library, so a framework's own environment can import it and the
runner never imports a framework.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..config import (GPU_SETTINGS, MODE_BEST, MODE_DEFAULT, SETTING_OWNER, TUNING_SETTINGS,
                      Topology, Tuning, Workload, tuning_flag)
from . import catalog

COLLECTIVE_TIMEOUT_ENV = "TRAINPERF_COLLECTIVE_TIMEOUT_S"
"""Seconds a rank waits in a collective before it gives its peer up (set for multi-node runs)."""


AUTOTUNE_FLAG = "--xla_gpu_autotune_level"
"""XLA's own autotuning of GEMMs and convolutions on a GPU (``xla/debug_options_flags.cc``:
"0 = off"): what JAX and TensorFlow's ``--mode xla`` run instead of cuDNN's own search."""


def xla_autotunes(xla_flags: str, level: int | None = None) -> bool:
    """Whether XLA autotunes: a compile option's ``level`` where the step was compiled with one,
    else the last level the ``XLA_FLAGS`` give (a user's shell may carry one), else XLA's own
    default, which autotunes."""
    if level is not None:
        return level > 0
    levels = [f.split("=", 1)[1] for f in xla_flags.split() if f.startswith(AUTOTUNE_FLAG + "=")]
    return not levels or levels[-1] != "0"


def own_gpu_ordinal(local_rank: int, seen: int, framework: str) -> int:
    """The GPU ordinal local rank ``local_rank`` opens in a process that sees ``seen`` GPUs
    (the list it was given): its own, the r-th, or ValueError in one line where there is none,
    never another rank's (the frameworks that give a process its node's GPUs: torch,
    OneFlow)."""
    if local_rank >= seen:
        raise ValueError(f"local rank {local_rank} has no GPU of its own: {framework} sees "
                         f"{seen} (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES')})")
    return local_rank


def rank_gpu(local_rank: int, visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a process that drives one GPU, local rank ``local_rank``:
    its entry of the list the launcher was given (``visible``, from the user's shell, a
    scheduler or an emulated node; None: unset, every device, so the local rank), or none where
    the list is shorter (a CPU run on fewer GPUs than ranks; a GPU run then fails in the
    worker, saying it sees none). Setting the local rank alone would put a rank on a device
    outside that list. The runner reads the energy of the same devices
    (``energy.run_entries``)."""
    if visible is None:
        return str(local_rank)
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    return devices[local_rank] if local_rank < len(devices) else ""


@dataclass(frozen=True)
class SourceBuild:
    """A package compiled from its source distribution against the packages already in the
    environment (pip's ``--no-build-isolation``): Horovod against MXNet's headers and library.
    Built last, never from a cached wheel, since the same release builds differently with
    other variables."""

    requirement: str
    """What pip installs (``horovod==0.28.1``)."""
    build_packages: tuple[str, ...] = ()
    """What its build imports, installed first (the environment is its build environment)."""
    tools: tuple[str, ...] = ()
    """Programs the build runs that must be on PATH (``cmake``, ``c++``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables of the build everywhere."""
    cuda_env: dict[str, str] = field(default_factory=dict)
    """Added on a machine with an NVIDIA GPU; ``{site}`` stands for the environment's
    site-packages folder."""
    cuda_links: dict[str, str] = field(default_factory=dict)
    """Links made before a CUDA build, ``{link: target}`` under ``{site}``: a name the build
    looks a library up by that a wheel leaves out."""
    cuda_home_var: str = ""
    """The variable that tells a CUDA build which CUDA toolkit to compile with (its folder)."""
    cuda_headers: tuple[str, ...] = ("cuda_runtime.h",)
    """Headers a CUDA build includes from the toolkit: a toolkit without them is passed over."""


@dataclass(frozen=True)
class EnvSpec:
    """How to build the framework's own environment (``trainperf env create NAME``)."""

    packages: tuple[str, ...]
    """pip requirements on a machine without CUDA: the framework and the numpy it needs."""
    cuda_packages: tuple[str, ...]
    """The same on a machine with an NVIDIA GPU (the framework's CUDA build)."""
    probe: str
    """Python run in the environment that prints a JSON object of the versions it holds."""
    pythons: tuple[str, ...] = ()
    """Python versions the framework's wheels exist for (``3.10``...), best first; empty: any,
    and the environment uses trainperf's own interpreter."""
    no_deps_packages: tuple[str, ...] = ()
    """Installed after ``packages`` without their dependencies (libraries a wheel loads but
    does not declare)."""
    source_builds: tuple[SourceBuild, ...] = ()
    """Compiled in the environment after everything else, in order."""
    cuda: str = ""
    """The CUDA release the CUDA build was compiled with (``11.7`` for mxnet-cu117): the
    driver it needs follows from it (``trainperf.gpufit``), and a source build's nvcc must be
    of its major version."""
    gpu_wheels: tuple[str, ...] = ()
    """The requirements (``name==version``) whose wheels carry the CUDA build's device code:
    the framework's own and the NVIDIA libraries the build pins. They are downloaded without
    their dependencies and read (``trainperf.gpucode``) to tell which GPUs the build runs on."""
    gpu_library: str = ""
    """The library in those wheels that holds the framework's own kernels (a path in its
    wheel, ``*`` for a hash in the name): whether it has code for a GPU decides whether the
    build runs there; the others' gaps are named beside it."""
    cuda_instead: str = ""
    """What to use where the CUDA build has no code for a GPU: another build, or why there is
    none. Empty: trainperf declares no other."""


@dataclass(frozen=True)
class Cluster:
    """Where every process of a run lives, as each node's launcher sees it: the nodes'
    addresses and, per node, ports free there for this run. Made by the runner after the nodes
    have met (``trainperf.rendezvous``), or for one node over loopback."""

    node_rank: int
    nproc_per_node: int
    addrs: tuple[str, ...]
    """One per node rank, each reachable from every other node."""
    ports: tuple[tuple[int, ...], ...]
    """One tuple per node rank: ports free on that node (the first of node 0 is the run's
    coordinator or master port)."""

    def __post_init__(self) -> None:
        if len(self.addrs) != len(self.ports) or not self.addrs:
            raise ValueError("a cluster needs one address and one port list per node")
        if not 0 <= self.node_rank < len(self.addrs):
            raise ValueError(f"node rank {self.node_rank} outside {len(self.addrs)} nodes")

    @property
    def nnodes(self) -> int:
        return len(self.addrs)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def master(self) -> tuple[str, int]:
        return self.addrs[0], self.ports[0][0]

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def to_json(self) -> str:
        return json.dumps({"node_rank": self.node_rank, "nproc_per_node": self.nproc_per_node,
                           "addrs": list(self.addrs), "ports": [list(p) for p in self.ports]})

    @classmethod
    def from_json(cls, text: str) -> "Cluster":
        d = json.loads(text)
        return cls(int(d["node_rank"]), int(d["nproc_per_node"]), tuple(d["addrs"]),
                   tuple(tuple(int(x) for x in p) for p in d["ports"]))


@dataclass(frozen=True)
class LaunchRequest:
    """What a backend needs to start one run."""

    python: str
    """The interpreter of the backend's environment."""
    topology: Topology
    tuning: Tuning
    spec_path: Path
    events_path: Path
    cluster: Cluster | None = None
    """Several nodes: where every node is (None: one node, over loopback)."""
    cluster_path: Path | None = None
    """``cluster`` as JSON, written by the runner for launchers that take ``--cluster``."""
    logs_dir: Path | None = None
    """Where each process's output file goes (None: the launcher's own output)."""

    @property
    def worker_args(self) -> list[str]:
        return ["--spec", str(self.spec_path), "--events", str(self.events_path)]


@dataclass(frozen=True)
class Launch:
    """One command that starts every process of a run (and stops them all when it is
    stopped), and the variables it adds to the environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


DEVICE_KINDS = ("cpu", "cuda")
KIND_WORDS = {"cpu": "a CPU", "cuda": "a GPU"}


@dataclass(frozen=True)
class Capabilities:
    """What a backend runs, declared once in its ``backend.py``. The runner refuses anything
    else before a run starts (``Backend.check``), the worker checks the same declaration
    against the device it found, and `trainperf list --frameworks` prints it (the README's
    framework table is that output)."""

    heads: tuple[str, ...]
    """Face head modes: ``dp``, ``mp``, ``pfc``. Classification runs data parallel."""
    precisions: dict[str, tuple[str, ...]]
    """Per device kind (``cpu``, ``cuda``): the precisions that run there."""
    families: tuple[str, ...]
    """The backbone families it builds (``backends.catalog``), each in every size."""
    modes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per device kind: how it can execute a training step, in its own terms (``eager``,
    ``compile``, ``graph``...), its default first. ``--mode best`` probes them all."""
    mode_words: dict[str, str] = field(default_factory=dict)
    """What each mode is, in the framework's API (``compile``: ``torch.compile, inductor``)."""
    float32_modes: dict[str, str] = field(default_factory=dict)
    """Modes that cannot compute in float64, with why: `trainperf align` refuses them before
    torch's side runs (their equivalence with the framework's own default mode is tested in
    float32 instead)."""
    float64_on: tuple[str, ...] = ("cpu",)
    """Device kinds on which its worker computes a strict alignment run's float64 as the
    check needs it (every kernel, or its stand-in, to float64 rounding): `trainperf align
    --device` refuses any other, with ``why_not["float64"]``. Every worker does on a CPU,
    where each float64 path and its stand-ins were measured."""
    channels_last: bool = False
    """Its backbones can run channels-last (``--memory-format channels_last``)."""
    channels_first: bool = True
    """Its backbones can run channels-first (``--memory-format channels_first``). False where
    NHWC is the only layout they are written in (TensorFlow's, JAX's): a run asked for NCHW is
    refused, and the worker records the NHWC it runs (``FrameworkRun.__init__``)."""
    layouts: dict[str, str] = field(default_factory=dict)
    """Per device kind, the memory format ``--memory-format auto`` runs its backbones in
    (``channels_last`` or ``channels_first``); a kind not named: channels-first."""
    real_data: bool = False
    """Reads a RecordIO dataset through the input pipeline (``run --data``)."""
    trains: bool = False
    """Trains to a verification accuracy (``trainperf train``): real-data input, checkpoints
    and verification sets."""
    several_nodes: bool = True
    """Its launch spans several nodes."""
    rule_differences: dict[str, str] = field(default_factory=dict)
    """Where its own kernels train by another rule than torch's, declared: the ending of the
    dumped tensors' names (``running_var``) -> why. `trainperf align` measures those tensors and
    prints the difference beside its verdict, which they do not decide; nothing else may
    differ."""
    tuning: dict[str, str] = field(default_factory=dict)
    """The speed settings it honours (``config.TUNING_SETTINGS`` names), each with the
    framework's own switch that does it (``{"cudnn_benchmark": "torch.backends.cudnn.
    benchmark"}``). A setting changed from its default that is not here is refused; what a run
    applied is recorded in its ``settings["tuning"]``."""
    why_not: dict[str, str] = field(default_factory=dict)
    """Why a precision or head it does not run is missing, said with the refusal
    (``{"bf16": "MXNet 1.9's bfloat16 AMP is CPU-only, through oneDNN"}``)."""

    @property
    def backbones(self) -> list[str]:
        return catalog.names(self.families)


@dataclass(frozen=True)
class Backend:
    name: str
    """What ``--framework`` takes: ``torch``, ``mxnet``..."""
    framework: str
    """What the worker writes as ``env.framework`` (``pytorch``, ``mxnet``)."""
    launch: Callable[[LaunchRequest], Launch]
    capabilities: Capabilities
    env: EnvSpec | None = None
    """None: the backend runs in trainperf's own interpreter."""
    cannot_run: str | None = None
    """Why this backend's environment can be built but no run started (None: it runs)."""
    runs_as: str = ""
    """How its worker is written (the API and compile path), for the framework table."""
    ranks_start: str = ""
    """How its ranks start, for the framework table."""
    refuse_more: Callable[[Workload, Topology, Tuning], str | None] | None = None
    """A rule of this backend's own that the declaration cannot say (it depends on a speed
    setting, say): why the case is refused, or None."""

    def head_refusal(self, fc: str) -> str | None:
        """Why this backend does not run face head mode ``fc``, or None."""
        heads = self.capabilities.heads
        if fc in heads:
            return None
        return f"the {self.name} backend runs --fc {', '.join(heads)}; not {fc}{self._why(fc)}"

    def precision_refusal(self, precision: str, device_kind: str) -> str | None:
        """Why this backend does not run ``precision`` on ``device_kind`` (``cpu`` or
        ``cuda``), or None."""
        precisions = self.capabilities.precisions
        here = precisions.get(device_kind, ())
        if precision in here:
            return None
        where = [k for k in DEVICE_KINDS if precision in precisions.get(k, ())]
        need = f"; {precision} needs {KIND_WORDS[where[0]]}" if where else ""
        return (f"the {self.name} backend runs --precision {', '.join(here)} on "
                f"{KIND_WORDS[device_kind]}{need}{self._why(precision)}")

    def float64_refusal(self, device_kind: str) -> str | None:
        """Why this backend's worker does not compute an alignment's float64 on
        ``device_kind``, or None."""
        if device_kind in self.capabilities.float64_on:
            return None
        on = " and ".join(KIND_WORDS[k] for k in self.capabilities.float64_on)
        return (f"the {self.name} backend's worker computes an alignment's float64 on {on} "
                f"only, not on {KIND_WORDS[device_kind]}{self._why('float64')}")

    def modes_on(self, device_kind: str) -> tuple[str, ...]:
        """The modes it declares on ``device_kind``, its default first."""
        return self.capabilities.modes.get(device_kind, ())

    def mode_refusal(self, mode: str, device_kind: str) -> str | None:
        """Why this backend does not run ``--mode mode`` on ``device_kind``, or None
        (``default`` and ``best`` run wherever it declares a mode)."""
        here = self.modes_on(device_kind)
        if not here:
            return (f"the {self.name} backend declares no execution mode on "
                    f"{KIND_WORDS[device_kind]}")
        if mode in (MODE_DEFAULT, MODE_BEST) or mode in here:
            return None
        where = [k for k in DEVICE_KINDS if mode in self.modes_on(k)]
        need = f"; {mode} needs {KIND_WORDS[where[0]]}" if where else ""
        return (f"the {self.name} backend runs --mode {', '.join(here)} on "
                f"{KIND_WORDS[device_kind]}{need}{self._why(mode)}")

    def resolve_mode(self, mode: str, device_kind: str) -> str:
        """The mode a run executes in: ``default`` is the first declared on ``device_kind``;
        ``best`` must have been chosen by the runner before it reaches here."""
        require(self.mode_refusal(mode, device_kind))
        if mode == MODE_BEST:
            raise ValueError("--mode best is the runner's to resolve, by probing each mode")
        return self.modes_on(device_kind)[0] if mode == MODE_DEFAULT else mode

    def default_layout(self, device_kind: str) -> str:
        """``channels_last`` or ``channels_first``: what ``--memory-format auto`` runs."""
        return self.capabilities.layouts.get(device_kind, "channels_first")

    def _why(self, what: str) -> str:
        why = self.capabilities.why_not.get(what)
        return f" ({why})" if why else ""

    def tuning_refusal(self, tuning: Tuning, device_kind: str) -> str | None:
        """Why a speed setting changed from its default is refused (one line): the backend
        has no switch of its own that honours it. Settings for another framework
        (``SETTING_OWNER``) and GPU settings on a CPU are not this run's to refuse. None:
        every changed setting is honoured."""
        default, declared = Tuning(), self.capabilities.tuning
        changed = [name for name in TUNING_SETTINGS
                   if getattr(tuning, name) != getattr(default, name) and name not in declared
                   and SETTING_OWNER.get(name, self.name) == self.name
                   and (device_kind == "cuda" or name not in GPU_SETTINGS)]
        if not changed:
            return None
        flags = ", ".join(tuning_flag(name, getattr(tuning, name)) for name in changed)
        honoured = ", ".join(declared) or "none"
        return (f"the {self.name} backend has no switch that honours {flags} (it honours: "
                f"{honoured}; `trainperf list --frameworks` shows each framework's)")

    def model_refusal(self, workload: Workload) -> str | None:
        """Why this backend does not build the workload's model (one line), or None: its
        backbone (and that backbone's task), its head mode, its memory format."""
        caps, name = self.capabilities, self.name
        try:
            entry = catalog.lookup(workload.backbone, caps.families, name)
        except ValueError as exc:
            return str(exc)
        if entry.task != workload.task:
            return (f"backbone {workload.backbone!r} is a {entry.task} backbone, but the "
                    f"workload is {workload.task}")
        if workload.task == "face":
            why = self.head_refusal(workload.fc)
            if why:
                return why
        if workload.channels_last and not caps.channels_last:
            return (f"the {name} backend runs its backbones channels-first only: use "
                    "--memory-format auto or channels_first")
        return None

    def work_refusal(self, workload: Workload, device_kind: str, train: bool = False,
                     real_data: bool = False) -> str | None:
        """Why this backend does not run the work (one line), or None: real data and
        training, ``model_refusal``, and its precision on ``device_kind`` (``cpu`` or
        ``cuda``). What a worker checks once it knows its device."""
        caps, name = self.capabilities, self.name
        if train and not caps.trains:
            return (f"the {name} backend does not train to accuracy yet (its worker has no "
                    "real-data input, checkpoints or verification; `trainperf list "
                    "--frameworks` says which do)")
        if real_data and not caps.real_data:
            return (f"the {name} backend reads synthetic data only (`trainperf list "
                    "--frameworks` says which read --data)")
        if self.cannot_run:
            return f"the {name} backend cannot run yet: {self.cannot_run}"
        return (self.model_refusal(workload)
                or self.precision_refusal(workload.precision, device_kind))

    def refusal(self, workload: Workload, topology: Topology, tuning: Tuning,
                device_kind: str, train: bool = False, real_data: bool = False) -> str | None:
        """Why this backend does not run the case (one line), or None: ``work_refusal``, and
        the case's layout (nodes, and the backend's own rules)."""
        why = (self.work_refusal(workload, device_kind, train, real_data)
               or self.mode_refusal(tuning.mode, device_kind)
               or self.tuning_refusal(tuning, device_kind)
               or self.layout_refusal(tuning))
        if why:
            return why
        if topology.nnodes > 1 and not self.capabilities.several_nodes:
            return (f"the {self.name} backend runs on one node here; multi-node launch is not "
                    "available for it yet")
        return (shard_refusal(workload, topology.nnodes * topology.devices_per_node)
                # The hook sees the device the run goes to, never ``auto``.
                or (self.refuse_more(workload, replace(topology, device=device_kind), tuning)
                    if self.refuse_more else None))

    def layout_refusal(self, tuning: Tuning) -> str | None:
        """Why ``--memory-format channels_first`` is refused: the backbones have no NCHW to
        run, and running NHWC under it would make the results say NCHW ran. Only the request
        is refused: a plan made without one (an alignment, a check) runs the layout there is."""
        if tuning.memory_format != "channels_first" or self.capabilities.channels_first:
            return None
        return (f"the {self.name} backend's backbones are NHWC only: use --memory-format auto "
                "or channels_last")

    def check(self, workload: Workload, topology: Topology, tuning: Tuning,
              device_kind: str, train: bool = False, real_data: bool = False) -> None:
        """ValueError with ``refusal``'s line when this backend does not run the case."""
        require(self.refusal(workload, topology, tuning, device_kind, train, real_data))


def shard_refusal(workload: Workload, world_size: int) -> str | None:
    """Why a sharded head cannot run on ``world_size`` ranks, or None: ``mp`` and ``pfc`` give
    each rank its own slice of the classes, and a rank with none has no logits to take part in
    the softmax with (every framework's collectives would then fail in its own words, or not
    at all)."""
    if workload.task != "face" or workload.fc not in ("mp", "pfc"):
        return None
    if workload.num_classes >= world_size:
        return None
    return (f"--fc {workload.fc} splits the {workload.num_classes} classes over {world_size} "
            f"ranks, leaving {world_size - workload.num_classes} of them without a class: use "
            f"--num-classes {world_size} or more, fewer ranks, or --fc dp")


def require(why: str | None) -> None:
    """Raise ``why`` (a refusal's one line) as a ValueError; None passes."""
    if why:
        raise ValueError(why)
