"""The scaling model: throughput at larger scales from one measured step and an alpha-beta model
of the collectives the step runs.

The batch per device stays fixed as devices are added (weak scaling, as DLPerf measured), and a
step at world size n (nodes x devices per node) takes

    step(n) = compute(n) + exposed communication(n)

**Compute per device.** ``dp`` (and classification networks, whose classifier is part of the
backbone): every device runs the whole model on its own B samples, so compute is the measured
base compute at every scale. ``mp`` / ``pfc``: the backbone part stays the same; the head part
is the class-matrix product of the device's shard against the embeddings of the whole global
batch, all-gathered: forward logits X W^T and the two backward products (gradients of X and of
W), 3 x 2 x (n B) x c(n) x D FLOPs for c(n) class rows of width D. For ``mp`` c(n) = C/n, so
n B x C/n = B x C: the head costs each device the same at every scale (each device does 1/n of
a problem n times larger) while the rows it keeps in memory fall as C/n. For ``pfc`` c(n) =
max(ratio x C/n, positives(n)), where positives(n) = (C/n)(1 - (1 - 1/C)^(n B)) is the expected
number of distinct labels of the n B gathered samples that fall in the shard (every one of them
must be kept, about B while n B << C). The head then costs B x max(ratio x C, n B) x 6D: the
same as on one device until n reaches ratio x C / B, and growing with n after that.

The measured base step is split into backbone and head in proportion to their FLOPs (assumed:
both run at the same achieved FLOP/s). Backbone FLOPs and parameters are counted on torch's meta
device (``trainperf.backends.torch.flops``: convolutions and linear layers, forward x 3 for a
training step); head FLOPs as above.

**Collectives** are rings, timed in nccl-tests' bus-bandwidth convention: a collective of S bytes
on n ranks takes ``latency + f x S / busbw`` with f = 2(n-1)/n for all-reduce (S = each rank's
buffer) and (n-1)/n for all-gather and reduce-scatter (S = the whole gathered output or the whole
input). busbw is the intra-node figure when all n ranks sit on one node and the inter-node
figure otherwise: a ring that leaves the node goes through each node's NIC, its slowest link.

- Gradient all-reduce, every mode: the backbone's parameters (plus the whole class matrix under
  ``dp``, which replicates it) x bytes per gradient, in buckets (DDP's 25 MiB). The backward
  pass takes 2/3 of the compute it covers (two forward-sized products against one) and the
  gradients come ready evenly over it; a bucket's all-reduce starts when its bytes are ready
  and the previous bucket's is done (one communication stream). Exposed = when the last one
  ends less when the backward ends: the last bucket always shows, the rest only when the
  all-reduce is slower than the backward. Under ``mp`` / ``pfc`` only the backbone's backward
  covers it: the head's shard is updated locally.
- Collectives that share the compute's cores (gloo on CPU nodes: its copies and sums and the
  kernel's TCP run on the cores the backward computes on) take part of them while they run
  beside it: the backward goes on at 1 - share and the all-reduce at 1 / slowdown of its own
  speed, both measured by commbench with a thread of matrix products beside its largest
  message (``Link.share_taken``, ``Link.slowdown``). The backward's stretch is a term of the
  step of its own. NCCL's kernels run apart from the host's compute: share 0 on GPUs, where
  their contention with the compute's kernels is left out.
- Head collectives (``mp``, ``pfc``), all on the critical path between the backbone's forward
  and its backward: all-gather of the embeddings (n B D x 4 bytes) and of the labels (n B x 8),
  three all-reduces of n B floats (row max, row sum of exponentials, target logit: latency
  bound) and the reduce-scatter of the embeddings' gradients (n B D x 4); on gloo, where
  trainperf's torch worker has no reduce-scatter, an all-reduce of them (twice the traffic).
  Latency bound as they are, a measured fabric's latency decides them: commbench takes it as
  the usual cost of a small message, not the luckiest.

**Stragglers.** Ranks meet at every step's collectives, so a step takes its slowest rank's
compute. Where the base's step times are known (a results.json), each rank's step is drawn
from them (each over its run's median) independently, and compute(n) is the expected slowest
of n draws against the average one (``straggler_factor``); a base of published throughput
alone has none, and its ranks are taken to be equal.

**A base on several devices** (a single-node case, say 1n8g) already holds some exposed
communication; its compute is the c that solves step0 = c + exposed(base, c) (step0 - c grows
with c, so bisection finds it). Whatever the model does not describe (input pipeline, kernel
contention, a framework's own overheads) then stays inside compute and is carried to every scale
unchanged.

Left out: NCCL's tree algorithm (on 2 nodes it can beat the ring's bandwidth), NCCL's kernels
slowing the compute's on a GPU, stragglers where no step times are known, and latency growing
with the node count (one latency per fabric level). Nothing is fitted to published
throughput, nor to the emulated 2-node runs that check the model
(``benchmarks/emulated_scaling.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .commbench import OPS, busbw_factor
MIB = 2**20
DEFAULT_BUCKET_BYTES = 25 * MIB
BACKWARD_SHARE = 2 / 3
# Labels travel as int64; embeddings and the softmax statistics as fp32 (the backbone ends in
# BatchNorm, which autocast keeps in fp32, and the margin softmax runs in fp32).
LABEL_BYTES = 8
FLOAT_BYTES = 4
HEAD_ALL_REDUCES = 3
# Round figures for when only bandwidths are given; see docs/scaling-model.md for why they
# barely matter at the message sizes these steps send.
DEFAULT_INTRA_LATENCY_S = 10e-6
DEFAULT_INTER_LATENCY_S = 30e-6
# A term under this share of the step is not worth naming as what limits scaling.
NEGLIGIBLE_SHARE = 0.005
# The most of the compute's speed a collective is taken to take: the scheduler never starves
# a runnable thread, so a probe that read (nearly) nothing left is noise.
MAX_SHARE_TAKEN = 0.95

_SCALE = re.compile(r"(\d+)n(\d+)g")


@dataclass(frozen=True)
class Scale:
    nodes: int
    devices_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(f"a scale needs at least 1 node and 1 device per node, got "
                             f"{self.nodes}n{self.devices_per_node}g")

    @property
    def name(self) -> str:
        return f"{self.nodes}n{self.devices_per_node}g"

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


def parse_scale(text: str) -> Scale:
    m = _SCALE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"scale {text.strip()!r} is not NODESnDEVICESg (e.g. 2n8g)")
    return Scale(int(m.group(1)), int(m.group(2)))


def parse_scales(text: str) -> list[Scale]:
    """``2n8g,4n8g`` -> scales in the order given, each once."""
    out: list[Scale] = []
    for part in text.split(","):
        if not part.strip():
            continue
        s = parse_scale(part)
        if s not in out:
            out.append(s)
    if not out:
        raise ValueError("--to needs at least one scale, e.g. 2n8g,4n8g")
    return out


@dataclass(frozen=True)
class Link:
    """One collective on one fabric level: latency + factor x bytes / busbw_Bps."""

    busbw_Bps: float
    latency_s: float
    share_taken: float = 0.0
    """The share of the compute's speed a large collective takes while it runs beside it on
    the same cores (commbench's on CPUs: gloo's copies and sums, the kernel's TCP); 0 where
    it runs apart from the compute (NCCL on GPUs)."""
    slowdown: float = 1.0
    """Its time beside the compute over its time alone."""

    def __post_init__(self) -> None:
        if not self.busbw_Bps > 0:
            raise ValueError(f"bus bandwidth must be > 0, got {self.busbw_Bps}")
        if not self.latency_s >= 0:
            raise ValueError(f"latency must be >= 0, got {self.latency_s}")
        if not 0 <= self.share_taken < 1:
            raise ValueError(f"the share taken must be in [0, 1), got {self.share_taken}")
        if not self.slowdown >= 1:
            raise ValueError(f"the slowdown beside compute must be >= 1, got {self.slowdown}")


@dataclass(frozen=True)
class Fabric:
    """Per level (``intra``: all ranks on one node, ``inter``: ranks on several nodes), a Link
    per collective. A level's missing collective uses its all-reduce figure: a ring's bus
    bandwidth is the link's speed whichever collective runs on it."""

    intra: dict[str, Link] = field(default_factory=dict)
    inter: dict[str, Link] = field(default_factory=dict)
    source: str = ""
    backend: str = ""
    """The collectives' library where known (``gloo``, ``nccl``); it decides how the face
    head's backward sends the embeddings' gradients (see ``head_collectives``)."""

    def link(self, op: str, multi_node: bool) -> Link:
        level = self.inter if multi_node else self.intra
        if not level:
            if multi_node:
                raise ValueError("more than one node needs the inter-node bandwidth: "
                                 "--inter-bw GB/s or --fabric with a multi-node commbench.json")
            raise ValueError("several devices on one node need the intra-node bandwidth: "
                             "--intra-bw GB/s or --fabric with a single-node commbench.json")
        return level.get(op) or level.get("all_reduce") or next(iter(level.values()))

    def to_dict(self) -> dict[str, Any]:
        def level(links: dict[str, Link]) -> dict[str, Any]:
            return {op: {"busbw_GBps": lk.busbw_Bps / 1e9, "latency_us": lk.latency_s * 1e6,
                         **({"share_taken": lk.share_taken, "slowdown": lk.slowdown}
                            if lk.share_taken or lk.slowdown != 1 else {})}
                    for op, lk in links.items()}

        return {"intra": level(self.intra), "inter": level(self.inter), "source": self.source,
                "backend": self.backend}


def uniform_fabric(intra_busbw_Bps: float | None = None, inter_busbw_Bps: float | None = None,
                   intra_latency_s: float = DEFAULT_INTRA_LATENCY_S,
                   inter_latency_s: float = DEFAULT_INTER_LATENCY_S,
                   source: str = "") -> Fabric:
    """One bandwidth and one latency per level for every collective."""
    intra = ({op: Link(intra_busbw_Bps, intra_latency_s) for op in OPS}
             if intra_busbw_Bps is not None else {})
    inter = ({op: Link(inter_busbw_Bps, inter_latency_s) for op in OPS}
             if inter_busbw_Bps is not None else {})
    return Fabric(intra, inter, source)


def fabric_from_commbench(measured: list[dict[str, dict]], fill: Fabric | None = None,
                          source: str = "") -> Fabric:
    """A Fabric from ``commbench.load_fabric`` outputs (one per file): a file measured on one
    node fills the intra level, one measured on several nodes the inter level. ``fill``
    supplies levels no file measured (the bandwidth flags)."""
    intra: dict[str, Link] = dict(fill.intra) if fill else {}
    inter: dict[str, Link] = dict(fill.inter) if fill else {}
    backends = set()
    for table in measured:
        for op, rec in table.items():
            if op not in OPS:
                continue
            level = inter if rec.get("nnodes", 1) > 1 else intra
            level[op] = Link(float(rec["busbw_Bps"]), float(rec["latency_s"]),
                             min(float(rec.get("compute_share_taken", 0.0)), MAX_SHARE_TAKEN),
                             max(1.0, float(rec.get("slowdown_beside_compute", 1.0))))
            backends.add(rec.get("backend", ""))
    return Fabric(intra, inter, source, backends.pop() if len(backends) == 1 else "")


def collective_s(fabric: Fabric, op: str, size_bytes: float, scale: Scale) -> tuple[float, float]:
    """(time, of which latency) of one ring collective of ``size_bytes`` at ``scale``."""
    n = scale.world_size
    if n == 1:
        return 0.0, 0.0
    link = fabric.link(op, scale.nodes > 1)
    if math.isinf(link.busbw_Bps):
        return link.latency_s, link.latency_s
    return link.latency_s + busbw_factor(op, n) * size_bytes / link.busbw_Bps, link.latency_s


@dataclass(frozen=True)
class Job:
    """What the model needs to know about one training step."""

    fc: str
    """``dp``, ``mp`` or ``pfc`` (classification networks: ``dp``)."""
    batch_size: int
    """Samples per device per step."""
    backbone_params: int
    """Parameters whose gradients every step all-reduces (the class matrix excluded)."""
    backbone_fwd_flops: float
    """Forward FLOPs of the backbone for one sample."""
    num_classes: int = 0
    """C of the face head; 0 for classification networks, whose classifier is in the backbone."""
    embedding_size: int = 0
    sample_ratio: float = 1.0
    grad_bytes: int = 4
    """Bytes of one all-reduced gradient element: 4 when parameters are fp32 (autocast, AMP),
    2 when the model itself is cast to fp16."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    overlap: bool = True
    """Bucket all-reduces run during the backward (DDP, Horovod); False: all after it."""

    def __post_init__(self) -> None:
        if self.fc not in ("dp", "mp", "pfc"):
            raise ValueError(f"fc must be dp, mp or pfc, got {self.fc!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.backbone_params < 0 or self.backbone_fwd_flops < 0:
            raise ValueError("backbone parameters and FLOPs must be >= 0")
        if self.num_classes and self.embedding_size < 1:
            raise ValueError("a face head needs embedding_size >= 1")
        if not self.num_classes and self.fc != "dp":
            raise ValueError(f"--fc {self.fc} needs a face head (num_classes > 0)")
        if not 0 < self.sample_ratio <= 1:
            raise ValueError(f"sample ratio must be in (0, 1], got {self.sample_ratio}")
        if self.grad_bytes < 1 or self.bucket_bytes < 1:
            raise ValueError("gradient bytes and bucket bytes must be >= 1")

    @property
    def sharded(self) -> bool:
        return self.fc in ("mp", "pfc") and self.num_classes > 0

    def shard_rows(self, world_size: int) -> float:
        """Class rows each device keeps: all of them under dp, C/n when sharded."""
        return self.num_classes / world_size if self.sharded else float(self.num_classes)

    def positives(self, world_size: int) -> float:
        """Expected distinct labels of the gathered batch that fall in one shard."""
        if not self.num_classes:
            return 0.0
        gathered = world_size * self.batch_size
        missed = math.expm1(gathered * math.log1p(-1 / self.num_classes))  # (1-1/C)^(nB) - 1
        return -self.shard_rows(world_size) * missed

    def computed_rows(self, world_size: int) -> float:
        """Class rows whose logits a device computes in a step."""
        rows = self.shard_rows(world_size)
        if self.fc == "pfc" and self.sample_ratio < 1:
            return min(rows, max(self.sample_ratio * rows, self.positives(world_size)))
        return rows

    def head_flops(self, world_size: int) -> float:
        """Training FLOPs of the class-matrix products on one device."""
        samples = self.batch_size * (world_size if self.sharded else 1)
        return 3 * 2 * samples * self.computed_rows(world_size) * self.embedding_size

    @property
    def backbone_flops(self) -> float:
        return 3 * self.backbone_fwd_flops * self.batch_size

    def head_share(self, world_size: int) -> float:
        head = self.head_flops(world_size)
        total = head + self.backbone_flops
        return head / total if total else 0.0

    @property
    def gradient_bytes(self) -> float:
        replicated = self.backbone_params + (0 if self.sharded
                                             else self.num_classes * self.embedding_size)
        return replicated * self.grad_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Overlap:
    """The bucketed gradient all-reduce against the backward it runs beside, in seconds."""

    busy_s: float
    """The buckets' all-reduces end to end, each at the fabric's speed."""
    exposed_s: float
    """Past the backward's end: when the last all-reduce ends less when the backward ends."""
    latency_s: float
    """Latency within busy_s."""
    stretch_s: float
    """How much longer the backward ran for the CPU the all-reduces took from its cores."""


def bucket_allreduce(total_bytes: float, bucket_bytes: float, backward_s: float, scale: Scale,
                     fabric: Fabric) -> Overlap:
    """The bucketed gradient all-reduce beside a backward of ``backward_s`` (see the module's
    docstring): buckets come ready evenly over the backward's work and go one after another.
    Where a collective shares the compute's cores (``Link.share_taken``), while both run the
    backward goes on at 1 - share and the all-reduce at 1 / ``Link.slowdown`` of its speed."""
    if scale.world_size == 1 or total_bytes <= 0:
        return Overlap(0.0, 0.0, 0.0, 0.0)
    count = math.ceil(total_bytes / bucket_bytes)
    sizes = [bucket_bytes] * (count - 1) + [total_bytes - bucket_bytes * (count - 1)]
    link = fabric.link("all_reduce", scale.nodes > 1)
    comms, busy, latency, ready = [], 0.0, 0.0, 0.0
    for size in sizes:
        ready += size
        t, alpha = collective_s(fabric, "all_reduce", size, scale)
        comms.append((backward_s * ready / total_bytes, t))
        busy += t
        latency += alpha
    backward_end, comm_end = _share_cores(backward_s, comms, link.share_taken, link.slowdown)
    return Overlap(busy, max(0.0, comm_end - backward_end), latency,
                   max(0.0, backward_end - backward_s))


def _share_cores(work_s: float, comms: list[tuple[float, float]], share: float,
                 slowdown: float) -> tuple[float, float]:
    """(when the backward ends, when the last collective ends), from the backward's start:
    ``work_s`` of compute, and collectives (the work done when each is ready, its seconds
    alone) one at a time in order; while one runs beside the compute, the compute goes at
    1 - ``share`` and the collective at 1 / ``slowdown``."""
    now = work = 0.0
    pending = list(comms)
    left: float | None = None  # seconds alone the running collective still needs
    backward_end = now if work_s <= 0 else None
    while pending or left is not None or backward_end is None:
        if left is None and pending and pending[0][0] <= work + 1e-12:
            left = pending.pop(0)[1]
            continue
        computing = backward_end is None
        beside = computing and left is not None
        work_rate = 1.0 - share if beside else 1.0
        comm_rate = 1.0 / slowdown if beside else 1.0
        steps = []
        if computing:
            target = work_s if left is not None or not pending else min(pending[0][0], work_s)
            steps.append((target - work) / work_rate)
        if left is not None:
            steps.append(left / comm_rate)
        dt = max(0.0, min(steps))
        now += dt
        if computing:
            work = min(work_s, work + dt * work_rate)
            if work >= work_s - 1e-12:
                backward_end = now
        if left is not None:
            left -= dt * comm_rate
            if left <= 1e-12:
                left = None
    return backward_end, now


def head_collectives(job: Job, scale: Scale, fabric: Fabric) -> tuple[float, float]:
    """(time, of which latency) of the sharded head's collectives; nothing under dp. The
    embeddings' gradients go back by a reduce-scatter, or on gloo (where trainperf's torch
    worker has none) by an all-reduce of them all, each rank keeping its rows."""
    if not job.sharded or scale.world_size == 1:
        return 0.0, 0.0
    gathered = scale.world_size * job.batch_size
    emb_bytes = gathered * job.embedding_size * FLOAT_BYTES
    calls = [("all_gather", emb_bytes), ("all_gather", gathered * LABEL_BYTES)]
    calls += [("all_reduce", gathered * FLOAT_BYTES)] * HEAD_ALL_REDUCES
    calls += [("all_reduce" if fabric.backend == "gloo" else "reduce_scatter", emb_bytes)]
    total = latency = 0.0
    for op, size in calls:
        t, alpha = collective_s(fabric, op, size, scale)
        total += t
        latency += alpha
    return total, latency


@dataclass(frozen=True)
class Terms:
    """One step at one scale, in seconds."""

    backbone_s: float
    head_s: float
    allreduce_s: float
    allreduce_exposed_s: float
    allreduce_latency_s: float
    head_comm_s: float
    head_comm_latency_s: float
    comm_cpu_s: float = 0.0
    """How much longer the backward ran for the CPU the all-reduce took from its cores."""
    straggler_s: float = 0.0
    """Waiting for the slowest rank: the expected slowest of n ranks' compute less a rank's."""

    @property
    def compute_s(self) -> float:
        return self.backbone_s + self.head_s

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.straggler_s + self.comm_cpu_s + self.allreduce_exposed_s
                + self.head_comm_s)

    @property
    def allreduce_exposed_latency_s(self) -> float:
        """The exposed all-reduce's latency, taken in the proportion latency has in its busy
        time (which buckets end up exposed is not tracked)."""
        share = self.allreduce_latency_s / self.allreduce_s if self.allreduce_s else 0.0
        return self.allreduce_exposed_s * share

    @property
    def exposed_latency_s(self) -> float:
        return self.allreduce_exposed_latency_s + self.head_comm_latency_s


def step_terms(job: Job, scale: Scale, fabric: Fabric, backbone_s: float, head_s: float,
               straggler: float = 1.0) -> Terms:
    """The step's terms; ``straggler``: the expected slowest rank's compute over a rank's
    (``straggler_factor``), 1 where it is not known."""
    covered = backbone_s if job.sharded else backbone_s + head_s
    backward = BACKWARD_SHARE * covered if job.overlap else 0.0
    ar = bucket_allreduce(job.gradient_bytes, job.bucket_bytes, backward, scale, fabric)
    comm, comm_latency = head_collectives(job, scale, fabric)
    return Terms(backbone_s, head_s, ar.busy_s, ar.exposed_s, ar.latency_s, comm, comm_latency,
                 ar.stretch_s, (backbone_s + head_s) * (straggler - 1.0))


def straggler_factor(step_ratios: tuple[float, ...], ranks: int) -> float:
    """E[max of ``ranks`` draws] / E[a draw], the draws taken independently from a measured
    rank's step times (each over its run's median, so that a run's drift is not counted as a
    step's jitter). Ranks meet at every step's collectives, so a step takes as long as its
    slowest rank's compute; 1 with no step times or one rank."""
    if ranks <= 1 or not step_ratios:
        return 1.0
    xs = sorted(step_ratios)
    count = len(xs)
    slowest = sum(x * ((i / count) ** ranks - ((i - 1) / count) ** ranks)
                  for i, x in enumerate(xs, 1))
    return slowest / (sum(xs) / count)


def base_compute_s(job: Job, base: Scale, step_s: float, fabric: Fabric,
                   straggler: float = 1.0) -> float:
    """Compute inside a measured step: the c with c + stragglers(c) + exposed communication(c)
    = step_s."""
    if base.world_size == 1:
        return step_s
    share = job.head_share(base.world_size)

    def modelled(c: float) -> float:
        return step_terms(job, base, fabric, c * (1 - share), c * share, straggler).step_s

    floor = modelled(0.0)
    if floor >= step_s:
        raise ValueError(
            f"the modelled communication at {base.name} alone ({floor * 1e3:.2f} ms) is longer "
            f"than the measured step ({step_s * 1e3:.2f} ms): the bandwidths given are too low "
            f"for this measurement")
    lo, hi = 0.0, step_s
    for _ in range(100):
        mid = (lo + hi) / 2
        if modelled(mid) < step_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class Prediction:
    scale: str
    nodes: int
    devices_per_node: int
    world_size: int
    samples_per_s: float
    step_s: float
    speedup: float
    scaling_efficiency: float
    backbone_s: float
    head_s: float
    allreduce_s: float
    allreduce_exposed_s: float
    head_comm_s: float
    exposed_latency_s: float
    comm_cpu_s: float
    """The backward's stretch: CPU the all-reduce took from the compute's cores."""
    straggler_s: float
    """Waiting for the slowest rank's compute."""
    class_rows_per_device: float
    computed_rows_per_device: float
    class_shard_bytes: float
    """fp32 bytes of the class rows one device keeps (the weight alone)."""
    limit: str
    """The largest part of the step: compute, head, an all-reduce, head collectives, latency."""
    overhead: str
    """What costs the most against one device: an all-reduce, head collectives, latency, head
    growth (pfc's positives), or none."""
    overhead_share: float
    """That overhead's share of the step."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def allreduce_label(scale: Scale) -> str:
    return "inter-node all-reduce" if scale.nodes > 1 else "intra-node all-reduce"


def _limit_and_overhead(t: Terms, scale: Scale, head_one_s: float, sharded: bool
                        ) -> tuple[str, str, float]:
    latency = t.exposed_latency_s
    ar_bw = t.allreduce_exposed_s - t.allreduce_exposed_latency_s
    parts = {"compute": t.backbone_s if sharded else t.compute_s,
             "head": t.head_s if sharded else 0.0,
             allreduce_label(scale): ar_bw,
             "head collectives": t.head_comm_s - t.head_comm_latency_s,
             "latency": latency,
             "CPU taken by the all-reduce": t.comm_cpu_s,
             "stragglers": t.straggler_s}
    limit = max(parts, key=lambda k: parts[k])
    costs = {allreduce_label(scale): ar_bw,
             "head collectives": parts["head collectives"],
             "latency": latency,
             "head growth": t.head_s - head_one_s if sharded else 0.0,
             "CPU taken by the all-reduce": t.comm_cpu_s,
             "stragglers": t.straggler_s}
    overhead = max(costs, key=lambda k: costs[k])
    share = costs[overhead] / t.step_s if t.step_s else 0.0
    if share < NEGLIGIBLE_SHARE:
        return limit, "none", max(share, 0.0)
    return limit, overhead, share


def project(job: Job, base: Scale, base_samples_per_s: float, scales: list[Scale],
            fabric: Fabric, step_ratios: tuple[float, ...] = ()) -> list[Prediction]:
    """Predictions at ``scales`` from a measured base (global samples/s at ``base``);
    ``step_ratios``: the base's step times over their run's median, for the stragglers (none:
    every rank takes the same time)."""
    if not base_samples_per_s > 0:
        raise ValueError(f"the base throughput must be > 0, got {base_samples_per_s}")
    base_step = base.world_size * job.batch_size / base_samples_per_s
    compute0 = base_compute_s(job, base, base_step, fabric,
                              straggler_factor(step_ratios, base.world_size))
    head0 = compute0 * job.head_share(base.world_size)
    backbone = compute0 - head0
    head_flops0 = job.head_flops(base.world_size)

    def head_at(world: int) -> float:
        return head0 * job.head_flops(world) / head_flops0 if head_flops0 else 0.0

    one_device_sps = job.batch_size / (backbone + head_at(1))
    out = []
    for s in scales:
        t = step_terms(job, s, fabric, backbone, head_at(s.world_size),
                       straggler_factor(step_ratios, s.world_size))
        sps = s.world_size * job.batch_size / t.step_s
        speedup = sps / one_device_sps
        limit, overhead, share = _limit_and_overhead(t, s, head_at(1), job.sharded)
        rows = job.shard_rows(s.world_size)
        out.append(Prediction(
            scale=s.name, nodes=s.nodes, devices_per_node=s.devices_per_node,
            world_size=s.world_size, samples_per_s=sps, step_s=t.step_s, speedup=speedup,
            scaling_efficiency=speedup / s.world_size, backbone_s=t.backbone_s,
            head_s=t.head_s, allreduce_s=t.allreduce_s,
            allreduce_exposed_s=t.allreduce_exposed_s, head_comm_s=t.head_comm_s,
            exposed_latency_s=t.exposed_latency_s, comm_cpu_s=t.comm_cpu_s,
            straggler_s=t.straggler_s,
            class_rows_per_device=rows,
            computed_rows_per_device=job.computed_rows(s.world_size),
            class_shard_bytes=rows * job.embedding_size * FLOAT_BYTES,
            limit=limit, overhead=overhead, overhead_share=share))
    return out


DLPERF_BACKBONES = {"r100": "iresnet100", "y1": "mobilefacenet_y1", "r50": "iresnet50",
                    "rn50": "resnet50_v1b"}


def backbone_counts(backbone: str, input_size: int, embedding_size: int = 512,
                    num_classes: int = 1000, output_block: str = "E") -> tuple[int, float]:
    """(parameters, forward FLOPs per sample) of a registered backbone (or a DLPerf model key),
    built on torch's meta device. Imports torch, which the rest of this module does not need."""
    from ..backends.torch.flops import backbone_profile

    params, flops = backbone_profile(DLPERF_BACKBONES.get(backbone, backbone), input_size,
                                     embedding_size=embedding_size, num_classes=num_classes,
                                     output_block=output_block)
    return params, float(sum(flops.values()))
