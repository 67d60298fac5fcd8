"""MXNet's side of a profiled run (``backends.phases``): phases closed by ``mx.nd.waitall`` and
the host clock (the default stamp: MXNet queues every operation on its engine, so only a fence
says that a phase's work is done), each phase a ``Task`` of MXNet's profiler in the domain
``trainperf``, and that profiler around the profiled steps. Its Chrome trace (one file per rank:
each process has its own profiler) tells which collectives ran inside which phase, and
``--trace`` keeps it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterator

import mxnet as mx

from ..phases import chrome_trace_hint, matmul_rate as timed_matmul_rate, ops_by_phase

DOMAIN = "trainperf"
COLLECTIVE_PREFIXES = ("KVStore", "horovod_")
"""How the profiler names the collectives: the dist kvstore's operations
(``KVStoreDistDefaultStoragePushPull``, ``dist_sync``), and Horovod's, which horovod.mxnet pushes
to the engine under its operation's name (``horovod_allreduce``, ``horovod_broadcast``)."""


class Ranges:
    """One reusable profiler ``Task`` per phase name."""

    def __init__(self) -> None:
        self.domain = mx.profiler.Domain(DOMAIN)
        self.tasks: dict[str, mx.profiler.Task] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        task = self.tasks.get(name)
        if task is None:
            task = self.tasks[name] = mx.profiler.Task(self.domain, name)
        task.start()
        try:
            yield
        finally:
            task.stop()


def method(sums_gradients: bool, face: bool) -> str:
    parts = ["mx.profiler Task ranges; phases closed by mx.nd.waitall() and the host clock"]
    if face:
        parts.append("the face head is written by hand with its backward to the embeddings, "
                     "which runs in head")
    if sums_gradients:
        parts.append("the gradient sum (Horovod's allreduce or the kvstore's pushpull) is "
                     "queued right after the backward, as in the timed step (the engine starts "
                     "each gradient's once it is written), and timed with it; gradient "
                     "communication not hidden = backward less backward without the sum, "
                     "alternate steps")
    return "; ".join(parts)


def matmul_rate(ctx: mx.Context, dtype: str) -> tuple[float, str]:
    """FLOP/s of ``mx.nd.dot`` on the run's first context in the class-matrix products'
    dtype."""
    n = 8192 if ctx.device_type == "gpu" else 1024
    a = mx.nd.random.normal(shape=(n, n), ctx=ctx).astype(dtype)
    b = mx.nd.random.normal(shape=(n, n), ctx=ctx).astype(dtype)
    rate = timed_matmul_rate(lambda: mx.nd.dot(a, b), 2.0 * n**3, mx.nd.waitall)
    return rate, f"mx.nd.dot {dtype} {n}^3"


class Profiler:
    """MXNet's profiler over the profiled steps. On exit its trace is dumped (into ``trace_dir``,
    or a scratch file) and read for the run's ``collectives``; with ``trace_dir``, rank 0's file
    is the run's ``trace``. kvstore ``device`` sums with plain copies and additions that its
    trace cannot tell from the step's own: there the collectives stay unknown (None), and
    without ``trace_dir`` the profiler does not run."""

    def __init__(self, run: Any, trace_dir: str | None) -> None:
        self.run, self.trace_dir = run, trace_dir
        self.tells = run.comm.mode != "device"
        self.path: str | None = None
        self.scratch: str | None = None

    def __enter__(self) -> "Profiler":
        if self.trace_dir:
            os.makedirs(self.trace_dir, exist_ok=True)
            self.path = os.path.join(self.trace_dir, f"mxnet-trace-rank{self.run.rank}.json")
        elif self.tells:
            self.scratch = tempfile.mkdtemp(prefix="trainperf-mxnet-profile-")
            self.path = os.path.join(self.scratch, "trace.json")
        if self.path:
            mx.profiler.set_config(profile_all=True, filename=self.path)
            mx.profiler.set_state("run")
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.path:
            return
        try:
            mx.profiler.set_state("stop")  # the last step's closing stamp fenced its work
            if exc[0] is not None:
                return
            mx.profiler.dump()
            if self.tells:
                with open(self.path) as f:
                    self.run.collectives = collectives_by_phase(json.load(f)["traceEvents"])
        finally:
            if self.scratch:
                shutil.rmtree(self.scratch, ignore_errors=True)
        if self.trace_dir and self.run.rank == 0:
            self.run.trace = self.path
            self.run.trace_open = chrome_trace_hint(self.path)


def collectives_by_phase(events: list[dict]) -> dict[str, list[str]]:
    """{phase: names of the collectives that started inside one of its ranges}."""
    opened: dict[str, float] = {}
    ranges = []
    ops = []
    for e in events:
        if e.get("cat") == DOMAIN and e.get("ph") in ("b", "e"):
            if e["ph"] == "b":
                opened[e["name"]] = e["ts"]
            elif e["name"] in opened:
                ranges.append((opened.pop(e["name"]), e["ts"], e["name"]))
        elif e.get("cat") == "operator" and e.get("ph") == "B" and e["name"].startswith(
                COLLECTIVE_PREFIXES):
            ops.append((e["ts"], e["name"]))
    return ops_by_phase(ranges, ops)
