"""Failures injected on purpose, for tests of how runs fail (stdlib only: every worker uses it).

``TRAINPERF_FAULT`` holds comma-separated ``KIND[=ARG]@STEP[:WORLD][/RANK]`` items. KIND is
``raise``, ``oom``, ``hang``, ``kill`` (the process dies at once, as under the kernel's OOM
killer, writing nothing), ``segv`` (it dies of SIGSEGV, as a native crash), ``abort=TEXT`` (it
prints TEXT to stderr, ``|`` separating lines, and aborts, as glibc does on a corrupted heap) or
``sleep=SECONDS``, or ``stop`` (the process suspends itself with SIGSTOP, as when someone
stops it from outside; it never resumes). An item with WORLD applies only to runs of that world
size; RANK (default 0) is the global rank that acts on it. ARG may hold ``:`` but not ``@`` or ``,``. In the torch
worker a STEP equal to the run's iterations strikes after the last step (after ``end``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable

Faults = dict[tuple[int, int], tuple[str, str]]


def parse_faults(world_size: int, text: str | None = None) -> Faults:
    """{(step, rank): (kind, argument)} of the faults asked for in runs of this world size."""
    if text is None:
        text = os.environ.get("TRAINPERF_FAULT", "")
    faults: Faults = {}
    for item in filter(None, text.split(",")):
        kind, _, where = item.rpartition("@")
        kind, _, arg = kind.partition("=")
        where, _, rank = where.partition("/")
        at, _, world = where.partition(":")
        if not world or int(world) == world_size:
            faults[(int(at or 0), int(rank or 0))] = (kind, arg)
    return faults


def inject(faults: Faults, index: int, rank: int,
           out_of_memory: Callable[[str], BaseException]) -> None:
    """Act on the fault planned for step ``index``; ``out_of_memory`` makes the framework's own
    out-of-memory error from a message, so the worker classifies it as it would a real one."""
    if (index, rank) not in faults:
        return
    kind, arg = faults[(index, rank)]
    if kind == "raise":
        raise RuntimeError("injected failure (TRAINPERF_FAULT)")
    if kind == "oom":
        raise out_of_memory("out of memory (injected by TRAINPERF_FAULT)")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind == "abort":
        for line in arg.split("|"):
            print(line, file=sys.stderr)
        sys.stderr.flush()
        os.abort()
    if kind == "hang":
        time.sleep(10**6)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "sleep":
        time.sleep(float(arg))
