"""The fabric benchmark: latency and bus bandwidth of collectives against message size.

Sizes and bandwidths follow nccl-tests' conventions, so a curve measured here reads like
theirs. The ranks run ``commbench_worker`` on the backend training uses (NCCL on GPUs, gloo on
CPUs); ``commbench_launch`` starts them (as ``trainperf run`` starts torch's ranks) and names a
failure. This module holds what is measured (``CommbenchSpec``), turns the ranks' times into
bandwidths and writes ``commbench.json`` (``trainperf.commbench/v1``), ``commbench.md`` and, with
matplotlib, ``commbench.png``. ``load_fabric`` hands the scaling model one latency and one bus
bandwidth per collective.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..results import read_json

SCHEMA = "trainperf.commbench/v1"
WORKER_MODULE = "trainperf.scale.commbench_worker"
OPS = ("all_reduce", "all_gather", "reduce_scatter")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

SIZE_DEFINITION = (
    "size as nccl-tests defines it: all_reduce, the bytes of the buffer on each rank; "
    "all_gather, the bytes of the whole gathered output (world x each rank's part); "
    "reduce_scatter, the bytes of the whole input (world x each rank's output)")
BUSBW_DEFINITION = (
    "algbw = size / time; busbw = algbw x 2(n-1)/n for all_reduce and algbw x (n-1)/n for "
    "all_gather and reduce_scatter, n = world size (nccl-tests' bus bandwidth: the traffic "
    "on the busiest link, comparable with the link's own speed whatever n is)")
TIME_DEFINITION = (
    "each rank's median over the timed iterations of one collective's time; the slowest "
    "rank's median is the point (the others wait for it)")
BESIDE_DEFINITION = (
    "on CPUs, the largest size timed again while a thread of each rank multiplies matrices on "
    "the same cores; the share taken is 1 - its products per second during the calls / alone, "
    "the busiest rank's")
FIT_METHOD = (
    "busbw = the bus traffic of the largest message over its time less the latency (a line "
    "through that end, not a least-squares fit: algorithm switches bend the middle of a real "
    "curve); latency = the median, over the sizes whose bandwidth term is under half their "
    "time, of time less that term (what a small collective costs as a rule, where the "
    "shortest time would be its luckiest call; the smallest size's time when none qualifies)")


class CommbenchError(RuntimeError):
    """The ranks failed, hung or left no results; the message says why."""


def busbw_factor(op: str, world_size: int) -> float:
    """busbw / algbw for ``op`` on ``world_size`` ranks (zero on one rank: nothing crosses)."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r} (known: {', '.join(OPS)})")


def message_sizes(min_bytes: int, max_bytes: int, factor: float, unit: int) -> list[int]:
    """The sweep min, min*factor, ... up to max, each rounded down to a multiple of ``unit``
    (world x element size, so every rank's part is whole) and at least one unit; sizes that
    rounding makes equal are kept once."""
    sizes: list[int] = []
    target = float(min_bytes)
    while target <= max_bytes:
        size = max(unit, int(target) // unit * unit)
        if not sizes or size > sizes[-1]:
            sizes.append(size)
        target *= factor
    return sizes


def _check_endpoint(text: str | None) -> None:
    host, _, port = (text or "").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--rdzv must be HOST:PORT, got {text!r}")


@dataclass(frozen=True)
class CommbenchSpec:
    """What to measure and where; checked on construction (ValueError for a user's mistake)."""

    devices_per_node: int = 2
    """Ranks per node: GPUs, or CPU processes on gloo."""
    nnodes: int = 1
    rdzv: str | None = None
    """HOST:PORT where the nodes meet, as ``trainperf run --rdzv`` (``rendezvous.NodeGroup``:
    torch's c10d rendezvous, hosted by the node at HOST); needed when nnodes > 1."""
    rdzv_id: str = "trainperf-commbench"
    """Names the job at the rendezvous, so two jobs on one endpoint do not mix."""
    ops: tuple[str, ...] = OPS
    min_bytes: int = 4 * 2**10
    max_bytes: int = 16 * 2**20
    factor: float = 2.0
    """Each size is the last one times this."""
    iters: int = 20
    """Timed iterations per size."""
    warmup: int = 5
    """Untimed iterations per size before them (connections, buffers, algorithm choice)."""
    dtype: str = "float32"
    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL)."""
    timeout_s: float = 900.0
    """The whole benchmark; past it every process is stopped."""

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nnodes < 1:
            raise ValueError("--devices and --nnodes must be >= 1")
        if self.nnodes > 1:
            _check_endpoint(self.rdzv)
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"--ops takes a list of {', '.join(OPS)}; got {','.join(self.ops)!r}")
        if len(set(self.ops)) != len(self.ops):
            raise ValueError(f"--ops names a collective twice: {','.join(self.ops)!r}")
        if self.min_bytes < 1 or self.min_bytes > self.max_bytes:
            raise ValueError(f"need 1 <= --min-bytes <= --max-bytes, got {self.min_bytes} and "
                             f"{self.max_bytes}")
        if not self.factor > 1:
            raise ValueError(f"--factor must be > 1, got {self.factor:g}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("--iters must be >= 1 and --warmup >= 0")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype takes one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if not self.timeout_s > 0:
            raise ValueError("--timeout must be > 0")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.devices_per_node

    @property
    def sizes(self) -> list[int]:
        unit = self.world_size * DTYPE_BYTES[self.dtype]
        return message_sizes(self.min_bytes, self.max_bytes, self.factor, unit)

    @property
    def collective_timeout_s(self) -> float:
        # A hung collective must fail inside the ranks, with their own message, before the
        # whole tree is stopped from outside with nothing said.
        return max(10.0, min(300.0, self.timeout_s / 2))


def progress_line(rank: int, op: str, size: int) -> str:
    """What a rank prints before a collective of ``size`` bytes (its place in the sweep)."""
    return f"commbench rank {rank} at {op}, {size} bytes"


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def document(spec: CommbenchSpec, raw: dict, env: dict) -> dict[str, Any]:
    """``trainperf.commbench/v1`` from the worker's raw times."""
    world = raw["world_size"]
    ops = []
    for rec in raw["ops"]:
        if "unsupported" in rec:
            ops.append(rec)
            continue
        factor = busbw_factor(rec["op"], world)
        points = [{"bytes": p["bytes"], "time_s": p["time_s"],
                   "algbw_GBps": p["bytes"] / p["time_s"] / 1e9,
                   "busbw_GBps": p["bytes"] / p["time_s"] / 1e9 * factor}
                  for p in rec["points"]]
        latency_s, busbw = fit_alpha_beta(points)
        out = {"op": rec["op"], "call": rec["call"], "busbw_factor": factor,
               "fit": {"latency_s": latency_s, "busbw_GBps": busbw / 1e9}, "points": points}
        beside = rec.get("beside_compute")
        if beside:
            alone = next(p["time_s"] for p in points if p["bytes"] == beside["bytes"])
            out["beside_compute"] = {**beside, "slowdown": beside["time_s"] / alone}
        ops.append(out)
    return {"schema": SCHEMA, "env": {**env, **raw.get("env", {})},
            "backend": raw["backend"], "device": spec.device, "nnodes": spec.nnodes,
            "devices_per_node": spec.devices_per_node, "world_size": world,
            "iters": spec.iters, "warmup": spec.warmup, "dtype": spec.dtype,
            "min_bytes": spec.min_bytes, "max_bytes": spec.max_bytes, "factor": spec.factor,
            "size_definition": SIZE_DEFINITION, "busbw_definition": BUSBW_DEFINITION,
            "time_definition": TIME_DEFINITION, "fit_method": FIT_METHOD,
            "beside_definition": BESIDE_DEFINITION, "ops": ops}


def fit_alpha_beta(points: list[dict]) -> tuple[float, float]:
    """(latency_s, busbw_bytes_per_s) of the model time = latency + busbw_factor x size / busbw,
    from points with ``bytes``, ``time_s`` and ``busbw_GBps`` (see FIT_METHOD)."""
    if not points:
        raise ValueError("no measured points to fit")
    pts = sorted(points, key=lambda p: p["bytes"])
    largest = pts[-1]
    bus_bytes = largest["busbw_GBps"] * 1e9 * largest["time_s"]
    if len(pts) == 1 or bus_bytes <= 0:  # no span to separate the terms, or nothing crossed
        return min(p["time_s"] for p in pts), largest["busbw_GBps"] * 1e9

    def busbw(latency_s: float) -> float:
        transfer_s = largest["time_s"] - latency_s
        return bus_bytes / transfer_s if transfer_s > 0 else largest["busbw_GBps"] * 1e9

    def fitted_latency(bw: float) -> float:
        # bus bytes of a point / bw is its bandwidth term, whatever the collective's factor
        small = [p["time_s"] - p["busbw_GBps"] * 1e9 * p["time_s"] / bw for p in pts
                 if p["busbw_GBps"] * 1e9 * p["time_s"] / bw < p["time_s"] / 2]
        return statistics.median(small) if small else pts[0]["time_s"]

    # The shortest time first bounds the latency from below; twice round settles both terms
    # (an exact alpha-beta curve is recovered exactly).
    latency_s = min(p["time_s"] for p in pts)
    for _ in range(2):
        latency_s = fitted_latency(busbw(latency_s))
    return latency_s, busbw(latency_s)


def load_fabric(path: str | Path) -> dict[str, dict[str, Any]]:
    """Per measured collective: {"latency_s", "busbw_Bps", "nnodes", "devices_per_node",
    "backend", "world_size"} from a commbench.json (or the folder holding one). A collective
    of ``size`` bytes (SIZE_DEFINITION) then takes about latency_s + factor x size / busbw_Bps,
    factor = busbw_factor(op, world). Measured on CPUs, also what a large one does beside
    computation on the same cores: "compute_share_taken" (the share of the computation's speed
    it takes) and "slowdown_beside_compute" (its time there over its time alone). Left out:
    collectives the backend lacks, and all of a one-rank run (nothing crosses a link, so its
    bus bandwidth is zero)."""
    p, doc = read_json(path, "commbench.json")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{p} is not a {SCHEMA} document")
    fabric = {}
    for rec in doc["ops"]:
        if not rec.get("points"):
            continue
        latency_s, busbw = fit_alpha_beta(rec["points"])
        if busbw > 0:
            fabric[rec["op"]] = {"latency_s": latency_s, "busbw_Bps": busbw,
                                 "nnodes": doc["nnodes"],
                                 "devices_per_node": doc["devices_per_node"],
                                 "backend": doc["backend"], "world_size": doc.get("world_size")}
            beside = rec.get("beside_compute")
            if beside and doc.get("device") == "cpu":
                fabric[rec["op"]].update(compute_share_taken=beside["compute_share_taken"],
                                         slowdown_beside_compute=beside["slowdown"])
    return fabric


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n // scale} {unit}" if n % scale == 0 else f"{n / scale:.2f} {unit}"
    return f"{n} B"


def markdown(doc: dict) -> str:
    lines = [f"# commbench: {doc['backend']} on {doc['device']}, {doc['nnodes']} node(s) x "
             f"{doc['devices_per_node']} ranks (world {doc['world_size']})", "",
             f"{doc['dtype']}; {doc['iters']} timed iterations after {doc['warmup']} warm-up "
             "per size. GB/s = 1e9 bytes/s.", "",
             f"- size: {SIZE_DEFINITION}", f"- {BUSBW_DEFINITION}", f"- time: {TIME_DEFINITION}",
             f"- fit: {FIT_METHOD}", ""]
    for rec in doc["ops"]:
        if "unsupported" in rec:
            lines += [f"## {rec['op']}", "", f"Not measured: {rec['unsupported']}", ""]
            continue
        fit = rec["fit"]
        lines += [f"## {rec['op']} (`torch.distributed.{rec['call']}`)", "",
                  f"latency {fit['latency_s'] * 1e6:.1f} us, busbw {fit['busbw_GBps']:.2f} GB/s",
                  "", "| size | bytes | time (us) | algbw (GB/s) | busbw (GB/s) |",
                  "|---:|---:|---:|---:|---:|"]
        lines += [f"| {human_bytes(p['bytes'])} | {p['bytes']} | {p['time_s'] * 1e6:.1f} | "
                  f"{p['algbw_GBps']:.3f} | {p['busbw_GBps']:.3f} |" for p in rec["points"]]
        beside = rec.get("beside_compute")
        if beside:
            lines += ["", f"Beside computation on the same cores ({BESIDE_DEFINITION}): "
                      f"{human_bytes(beside['bytes'])} took {beside['time_s'] * 1e6:.1f} us "
                      f"({beside['slowdown']:.2f} x alone) and "
                      f"{beside['compute_share_taken']:.1%} of the computation's speed."]
        lines.append("")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> bool:
    """busbw against size, one line per collective; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rec in doc["ops"]:
        if rec.get("points"):
            ax.plot([p["bytes"] for p in rec["points"]], [p["busbw_GBps"] for p in rec["points"]],
                    marker="o", label=rec["op"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes, nccl-tests' definition)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{doc['backend']} on {doc['device']}: {doc['nnodes']} node(s) x "
                 f"{doc['devices_per_node']} ranks, {doc['dtype']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return True
