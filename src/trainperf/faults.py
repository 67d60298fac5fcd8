"""Failures injected on purpose, for tests of how runs fail (stdlib only: every worker uses it).

``TRAINPERF_FAULT`` holds comma-separated ``KIND[=ARG]@STEP[:WORLD]`` items. KIND is ``raise``,
``oom``, ``hang``, ``kill`` (the process dies at once, as under the kernel's OOM killer, writing
nothing) or ``sleep=SECONDS``; an item with WORLD applies only to runs of that world
size. Only rank 0 acts on them.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

Faults = dict[int, tuple[str, str]]


def parse_faults(world_size: int, text: str | None = None) -> Faults:
    """{step: (kind, argument)} of the faults asked for in runs of this world size."""
    if text is None:
        text = os.environ.get("TRAINPERF_FAULT", "")
    faults: Faults = {}
    for item in filter(None, text.split(",")):
        kind_step, _, world = item.partition(":")
        kind, _, at = kind_step.partition("@")
        kind, _, arg = kind.partition("=")
        if not world or int(world) == world_size:
            faults[int(at or 0)] = (kind, arg)
    return faults


def inject(faults: Faults, index: int, rank: int,
           out_of_memory: Callable[[str], BaseException]) -> None:
    """Act on the fault planned for step ``index``; ``out_of_memory`` makes the framework's own
    out-of-memory error from a message, so the worker classifies it as it would a real one."""
    if index not in faults or rank != 0:
        return
    kind, arg = faults[index]
    if kind == "raise":
        raise RuntimeError("injected failure (TRAINPERF_FAULT)")
    if kind == "oom":
        raise out_of_memory("out of memory (injected by TRAINPERF_FAULT)")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(10**6)
    if kind == "sleep":
        time.sleep(float(arg))
