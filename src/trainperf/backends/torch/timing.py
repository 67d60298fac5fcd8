"""Per-step timers that never force a sync, and the measured loop.

The loop is the training step and nothing else: no .item(), no logging that waits on the device.
The device is synchronised only at the window's edges. Per-step times come from CUDA events on a
GPU (read when they have completed, without waiting) and from the host clock on the CPU, where
every op has finished when the call returns.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


class HostStepTimer:
    """CPU: consecutive host timestamps, so a window's step times add up to its wall time."""

    def __init__(self) -> None:
        self._last = 0.0
        self._done: list[tuple[int, float]] = []

    def start(self) -> float:
        self._last = time.perf_counter()
        return self._last

    def mark(self, index: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self._done.append((index, now - self._last))
        self._last = now

    def drain(self) -> list[tuple[int, float]]:
        done, self._done = self._done, []
        return done


class CudaStepTimer:
    """GPU: an event after each step; a step's time is the gap between consecutive events."""

    def __init__(self) -> None:
        self._prev: torch.cuda.Event | None = None
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> float:
        self._prev = torch.cuda.Event(enable_timing=True)
        self._prev.record()
        return time.perf_counter()

    def mark(self, index: int, now: float | None = None) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._pending.append((index, self._prev, event))
        self._prev = event

    def drain(self) -> list[tuple[int, float]]:
        done = []
        while self._pending and self._pending[0][2].query():  # query() does not block
            index, begin, end = self._pending.pop(0)
            done.append((index, begin.elapsed_time(end) / 1000.0))
        return done


def make_timer(device: torch.device) -> HostStepTimer | CudaStepTimer:
    return CudaStepTimer() if device.type == "cuda" else HostStepTimer()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_loop(step: Callable[[], torch.Tensor], iters: int, warmup: int, device: torch.device,
               on_steps: Callable[[list[tuple[int, float]]], None] = lambda _: None,
               barrier: Callable[[], None] = lambda: None,
               ) -> tuple[float, list[torch.Tensor]]:
    """Run ``iters`` steps; returns (wall seconds of the steps after ``warmup``, losses).

    ``on_steps`` receives (index, seconds) of steps as their times become known.
    """
    timer = make_timer(device)
    losses: list[torch.Tensor] = []
    window_start = timer.start()
    for i in range(iters):
        if i == warmup:
            # Deliberate sync and barrier: the window starts with every rank idle and aligned,
            # so no warm-up work or a late rank is billed to the measured steps.
            synchronize(device)
            barrier()
            window_start = timer.start()
        losses.append(step())
        if i < iters - 1:
            timer.mark(i)
            on_steps(timer.drain())
    synchronize(device)  # deliberate: the window ends when the device has finished its work
    window_end = time.perf_counter()
    # The last step ends with the window, so on the CPU the window's step times add up to it.
    timer.mark(iters - 1, window_end)
    on_steps(timer.drain())
    return window_end - window_start, losses
