"""Per-step timers that never force a sync inside the window, and the measured loop.

The loop is the training step and nothing else: no .item(), no logging that waits on the device.
The device is synchronised only at the window's edges. Per-step times come from CUDA events on a
GPU (read when they have completed, without waiting, until the window has ended) and from the
host clock on the CPU, where every op has finished when the call returns.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

StepTimes = list[tuple[int, float]]


class HostStepTimer:
    """CPU: consecutive host timestamps, so a step's time is the gap to the previous mark."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._last = 0.0
        self._done: StepTimes = []

    def now(self) -> float:
        return self.clock()

    def sync(self) -> None:
        """Nothing to wait for: CPU ops have finished when they return."""

    def start(self) -> float:
        self._last = self.clock()
        return self._last

    def mark(self, index: int) -> None:
        now = self.clock()
        self._done.append((index, now - self._last))
        self._last = now

    def drain(self, wait: bool = False) -> StepTimes:
        done, self._done = self._done, []
        return done


class CudaStepTimer:
    """GPU: an event after each step; a step's time is the gap between consecutive events."""

    def __init__(self, device: torch.device, event_factory: Callable[[], object] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = device
        self.clock = clock
        self._new_event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._prev = None
        self._pending: list[tuple[int, object, object]] = []

    def now(self) -> float:
        return self.clock()

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def start(self) -> float:
        self._prev = self._new_event()
        self._prev.record()
        return self.clock()

    def mark(self, index: int) -> None:
        event = self._new_event()
        event.record()
        self._pending.append((index, self._prev, event))
        self._prev = event

    def drain(self, wait: bool = False) -> StepTimes:
        """Times of the steps whose end event has completed. With ``wait`` (after the window has
        ended), wait for every pending event, so no step of the window goes without its time."""
        done = []
        while self._pending:
            index, begin, end = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():  # query() does not block
                break
            self._pending.pop(0)
            done.append((index, begin.elapsed_time(end) / 1000.0))
        return done


def make_timer(device: torch.device) -> HostStepTimer | CudaStepTimer:
    return CudaStepTimer(device) if device.type == "cuda" else HostStepTimer()


def timed_loop(step: Callable[[], torch.Tensor], iters: int, warmup: int,
               timer: HostStepTimer | CudaStepTimer,
               on_steps: Callable[[StepTimes], None] = lambda _: None,
               barrier: Callable[[], None] = lambda: None,
               ) -> tuple[float, list[torch.Tensor]]:
    """Run ``iters`` steps; returns (wall seconds of the steps from index ``warmup`` on, losses).

    ``on_steps`` receives (index, seconds) of steps as their times become known; by the time
    this returns it has received every step, the last one included.
    """
    losses: list[torch.Tensor] = []
    window_start = timer.start()
    for i in range(iters):
        if i == warmup:
            # Deliberate sync and barrier: the window starts with every rank idle and aligned,
            # so no warm-up work or a late rank is billed to the measured steps.
            timer.sync()
            barrier()
            window_start = timer.start()
        losses.append(step())
        timer.mark(i)
        on_steps(timer.drain())
    timer.sync()  # deliberate: the window ends when the device has finished its work
    window_end = timer.now()
    on_steps(timer.drain(wait=True))
    return window_end - window_start, losses
