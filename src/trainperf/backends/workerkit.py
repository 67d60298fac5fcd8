"""Pieces the workers share (stdlib only): out-of-memory recognition, CPU memory figures and
limits, GPU names, the protocol's entry point with its failure handling, and the way out."""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from typing import Any, Callable, NoReturn

from ..config import Measure
from ..protocol import Error, EventWriter, RunSpec, Step
from .loop import StepTimes, use_short_switch_interval

OOM_TEXTS = ("out of memory", "std::bad_alloc", "failed to allocate", "cannot allocate memory",
             "memory allocation failed", "cudaerrormemoryallocation", "resource_exhausted",
             "resourceexhaustederror", "resource exhausted")


def is_oom(exc: BaseException) -> bool:
    """An allocation failure, by type or by the words frameworks put in their messages."""
    if isinstance(exc, MemoryError):
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return any(t in text for t in OOM_TEXTS)


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


def leave(code: int) -> NoReturn:
    """End the process now, without the interpreter's teardown: every event is written (each
    line in one ``write``) and every rank is past its last collective, so nothing the run needs
    is left, while a framework's C++ destructors and atexit hooks, racing with its own
    background threads, can still crash a process that has finished its work (seen as a
    SIGABRT after the last step) or take seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_main(argv: list[str] | None, doc: str,
                run: Callable[[RunSpec, EventWriter], Any],
                hard_exit: Callable[[], bool] = lambda: False) -> int:
    """Parse ``--spec``/``--events``, call ``run(spec, events)``, and turn any failure into an
    ``error`` event and the protocol's exit code. ``hard_exit()`` true (a distributed run has
    started): leave with ``os._exit``, because a framework's normal shutdown would wait on
    peers that will never answer; the launcher stops the rest."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="JSON file: workload, measure, device")
    parser.add_argument("--events", required=True, help="JSON-lines file to append events to")
    args = parser.parse_args(argv)
    use_short_switch_interval()
    events = EventWriter(args.events, int(os.environ.get("TRAINPERF_LOCAL_RANK", "0")))
    try:
        run(RunSpec.load(args.spec), events)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes an event
        error = Error.of_exception(exc, is_oom(exc))
        events.emit(error)
        if hard_exit():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(error.exit_code)
        return error.exit_code
    return 0


class StepReporter:
    """The ``on_steps`` of ``timed_loop``: rank 0 writes each timed step's event; every rank
    keeps the indices so that ``check_complete`` can assert that every step got its time, in
    order. ``first`` runs once, before the first step's event (a worker that learns something
    for its ``start`` event only from the first step writes it there)."""

    def __init__(self, events: EventWriter, rank: int, measure: Measure, global_batch: int,
                 first: Callable[[], None] | None = None) -> None:
        self.events, self.rank, self.measure = events, rank, measure
        self.global_batch = global_batch
        self.first = first
        self.timed: list[int] = []

    def __call__(self, done: StepTimes) -> None:
        if done and self.first is not None:
            first, self.first = self.first, None
            first()
        self.timed.extend(index for index, _ in done)
        if self.rank == 0:
            for index, seconds in done:
                self.events.emit(Step(index=index, seconds=seconds, samples=self.global_batch,
                                      warmup=index < self.measure.warmup))

    def check_complete(self) -> None:
        assert self.timed == list(range(self.measure.iters)), \
            "every step must have its time, in order"


def memory_fields(per_rank, with_reserved: bool) -> dict:
    """The ``end`` event's memory figures from every rank's gathered ``(peak[, reserved])``
    row: the largest over ranks, and each rank's peak."""
    peaks = [int(row[0]) for row in per_rank]
    out: dict = {"peak_memory_bytes": max(peaks), "peak_memory_bytes_per_rank": peaks}
    if with_reserved:
        out["peak_reserved_bytes"] = max(int(row[1]) for row in per_rank)
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
