"""The phases of a profiled step, and the clock that times them (standard library only: every
worker uses it).

A profiled run (``RunSpec.profile``) runs its steps phase by phase. Each phase is a named range
of the framework's own profiler (``annotate``), so that its trace shows the same names, and is
closed by a ``stamp``: a fence that waits for the device and reads the host clock, or, where the
framework has device timers (torch's CUDA events), an event recorded on the device's stream
without a wait. A phase's time is its closing stamp less its opening one; whatever runs between
phases is ``other``. The phases are framework-neutral:

- ``data``: getting the step's batch;
- ``backbone_forward``;
- ``head``: the FC, margin and softmax, forward and, where the framework can run it apart, the
  backward to the embedding, with the head's collectives (``mp``, ``pfc``);
- ``backward``: the backbone's backward, with the part of the gradient all-reduce it hides;
- ``grad_comm``: gradient communication not hidden by compute;
- ``optimizer``: clipping, the update, the rate schedule and zeroing the gradients.

A framework that cannot tell two phases apart (one compiled program) names one phase that joins
them with ``+`` and says why (``Phases.merged``); no split is ever guessed.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, ContextManager, Iterator

PHASES = ("data", "backbone_forward", "head", "backward", "grad_comm", "optimizer", "other")
LABELS = {"data": "data", "backbone_forward": "backbone forward", "head": "head",
          "backward": "backward", "grad_comm": "gradient communication not hidden",
          "optimizer": "optimizer", "other": "other"}
NO_COMM = "no_comm"
"""The variant of a step run without the gradient all-reduce (torch DDP's ``no_sync``): the
backward's time without it tells how much of the all-reduce the backward does not hide."""
DELAY_ENV = "TRAINPERF_PHASE_DELAY"
"""``PHASE=SECONDS[,...]``: sleep that long inside the phase's range, every profiled step (a
fault hook for tests: the delay must show in that phase and nowhere else)."""

Stamp = Callable[[], Any]
Elapsed = Callable[[Any, Any], float]
Annotate = Callable[[str], ContextManager[Any]]


def label(name: str) -> str:
    """A phase's name for people; a merged phase's parts joined with `` + `` (inside one, the
    communication is whatever the program overlaps or not: no longer "not hidden")."""
    parts = name.split("+")
    if len(parts) > 1:
        return " + ".join("gradient communication" if p == "grad_comm" else LABELS.get(p, p)
                          for p in parts)
    return LABELS.get(name, name)


def check_phase(name: str) -> None:
    parts = name.split("+")
    if not parts or any(p not in PHASES or p == "other" for p in parts) or len(set(parts)) < len(
            parts):
        raise ValueError(f"{name!r} is not a phase (or phases joined with +) of {PHASES[:-1]}")


def delays_from_env(text: str | None = None) -> dict[str, float]:
    """{phase: seconds} of ``TRAINPERF_PHASE_DELAY``."""
    text = os.environ.get(DELAY_ENV, "") if text is None else text
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, seconds = item.partition("=")
        check_phase(name)
        out[name] = float(seconds)
    return out


def host_stamp(fence: Callable[[], None]) -> Stamp:
    """A stamp that waits for the device (``fence``) and reads the host clock."""
    def stamp() -> float:
        fence()
        return time.perf_counter()
    return stamp


def no_range(name: str) -> ContextManager[Any]:
    return contextlib.nullcontext()


class PhaseClock:
    """Times each profiled step and its phases; ``records`` resolves the stamps (after the
    device has finished: device events are read only then)."""

    def __init__(self, stamp: Stamp, elapsed: Elapsed = lambda a, b: b - a,
                 annotate: Annotate = no_range, delays: dict[str, float] | None = None) -> None:
        self.stamp, self.elapsed, self.annotate = stamp, elapsed, annotate
        self.delays = delays or {}
        self.delayed: set[str] = set()
        self._steps: list[tuple[str, Any, Any, list[tuple[str, Any, Any]]]] = []
        self._open: list[tuple[str, Any, Any]] | None = None

    @contextlib.contextmanager
    def step(self, variant: str = "") -> Iterator[None]:
        phases: list[tuple[str, Any, Any]] = []
        self._open = phases
        begin = self.stamp()
        yield
        end = self.stamp()
        self._open = None
        self._steps.append((variant, begin, end, phases))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (inside a ``step``), in the profiler's range. A
        phase may run more than once in a step (the optimizer zeroes the gradients first and
        updates last): its times add up."""
        check_phase(name)
        if self._open is None:
            raise RuntimeError(f"phase {name!r} outside a profiled step")
        with self.annotate(name):
            begin = self.stamp()
            yield
            if name in self.delays and not any(n == name for n, _, _ in self._open):
                # After the phase's work, not beside it: an asynchronous framework would
                # otherwise run its queued work during the sleep and hide it.
                self.stamp()
                time.sleep(self.delays[name])
                self.delayed.add(name)
            end = self.stamp()
        self._open.append((name, begin, end))

    def check_delays(self) -> None:
        """ValueError when ``TRAINPERF_PHASE_DELAY`` names phases of which no step ran any (a
        framework that merges them into another): a test would otherwise pass for the wrong
        reason. One setting serves a whole matrix, so a name that only another case runs (a
        merged phase of another world size) is no error."""
        if self.delays and not self.delayed:
            raise ValueError(f"{DELAY_ENV} names {', '.join(sorted(self.delays))}, none of "
                             "which a profiled step of this framework ran (it merges phases: "
                             "name the merged one)")

    def records(self) -> list[dict[str, Any]]:
        """Every step: ``seconds``, ``phases`` ({name: seconds}, ``other`` last) and
        ``variant`` (``Phases.steps``)."""
        out = []
        for variant, begin, end, phases in self._steps:
            total = self.elapsed(begin, end)
            times: dict[str, float] = {}
            for name, a, b in phases:
                times[name] = times.get(name, 0.0) + self.elapsed(a, b)
            times["other"] = total - sum(times.values())
            out.append({"seconds": total, "phases": times, "variant": variant})
        return out


def compiled_step_phase(world_size: int) -> str:
    """The merged phase of a step compiled into one program (JAX, TensorFlow): with one rank
    it holds no collective."""
    parts = ["backbone_forward", "head", "backward", "optimizer"]
    if world_size > 1:
        parts.insert(3, "grad_comm")
    return "+".join(parts)


def ops_by_phase(ranges: list[tuple[float, float, str]],
                 ops: list[tuple[float, str]]) -> dict[str, list[str]]:
    """{phase: names of the ``ops`` (start, name) that started inside one of its ``ranges``
    (start, end, phase)}, from a profiler's events; the innermost range holds an op."""
    found: dict[str, set[str]] = {}
    for start, name in ops:
        holders = [r for r in ranges if r[0] <= start <= r[1]]
        if holders:
            phase = min(holders, key=lambda r: r[1] - r[0])[2]
            found.setdefault(phase, set()).add(name)
    return {phase: sorted(names) for phase, names in found.items()}


def chrome_trace_hint(path: str) -> str:
    """How to open a Chrome-trace JSON (``FrameworkRun.trace_open``)."""
    return (f"open https://ui.perfetto.dev (offline: chrome://tracing) and load "
            f"{os.path.basename(path)}")


def matmul_rate(matmul: Callable[[], Any], flops: float, fence: Callable[[], None],
                min_s: float = 0.3, repeats: int = 3) -> float:
    """FLOP/s of ``matmul`` (one product of ``flops`` FLOPs, queued on the device), the best of
    ``repeats`` batches each timed over at least ``min_s``."""
    matmul()
    fence()
    best = 0.0
    for _ in range(repeats):
        count, begin = 0, time.perf_counter()
        while True:
            matmul()
            count += 1
            fence()
            spent = time.perf_counter() - begin
            if spent >= min_s / repeats:
                break
        best = max(best, count * flops / spent)
    return best
