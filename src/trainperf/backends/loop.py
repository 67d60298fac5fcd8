"""The measured loop shared by the workers of asynchronous frameworks (stdlib only).

MXNet, Paddle on a GPU, JAX and TensorFlow queue a step's work and return before it is done, so
a step's time cannot be read from the host clock around the call. The analogue of torch's CUDA
events is a watcher thread: after each step the loop hands it that step's markers (arrays that
become ready when the step's last update has run); the watcher waits on them in step order
(each framework's wait releases the GIL while it blocks) and stamps the host clock when they are
ready, so a step's time is the gap between consecutive stamps. The loop itself reads nothing
back: it only lets at most ``max_in_flight`` steps be outstanding (one running, one queued: the
device never waits for the host, and queued steps do not pile up memory). At the window's edges
it syncs the device (``sync``), lets the watcher catch up, and (at the start) meets the other
ranks at a barrier. Every step has its time when ``timed_loop`` returns.

A framework that runs synchronously (Paddle or TensorFlow eager on a CPU) passes a ``wait`` that
does nothing: the stamps are then the host clock after each call, which is the step's time.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any, Callable, Sequence

MAX_STEPS_IN_FLIGHT = 2
SWITCH_INTERVAL_S = 2e-4
"""How long the main thread may hold the GIL while the watcher waits to stamp a finished step
(Python's default, 5 ms, would blur per-step times). Workers set it at start."""

StepTimes = list[tuple[int, float]]
Wait = Callable[[Sequence[Any]], None]


def use_short_switch_interval() -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)


class StepWatcher:
    """Stamps the host clock when each submitted step's arrays are ready, in step order."""

    def __init__(self, wait: Wait, clock: Callable[[], float] = time.perf_counter,
                 max_in_flight: int = MAX_STEPS_IN_FLIGHT) -> None:
        self.wait = wait
        self.clock = clock
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(max_in_flight)
        self._lock = threading.Lock()
        self._done: StepTimes = []
        self._last = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trainperf-step-watcher",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                kind, value, arrays = item
                if kind == "reset":
                    self._last = value
                    continue
                try:
                    if self.error is None:
                        self.wait(arrays)
                except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                    self.error = exc
                now = self.clock()
                with self._lock:
                    self._done.append((value, now - self._last))
                self._last = now
                self._slots.release()
            finally:
                self._queue.task_done()

    def reset(self, t: float) -> None:
        """The next step's time counts from ``t``."""
        self._queue.put(("reset", t, ()))

    def submit(self, index: int, arrays: Sequence[Any]) -> None:
        """Hand over step ``index``; blocks while ``max_in_flight`` steps are not yet done."""
        self._slots.acquire()
        self._queue.put(("step", index, list(arrays)))

    def drain(self) -> StepTimes:
        with self._lock:
            done, self._done = self._done, []
        return done

    def catch_up(self) -> None:
        """Wait until every submitted step is stamped."""
        self._queue.join()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self, wait: bool = True) -> None:
        """Stop the thread; ``wait=False`` after a failure, when it may be blocked on a step
        that never finishes (a daemon thread does not hold up the exit)."""
        self._queue.put(None)
        if wait:
            self._thread.join()


def timed_loop(step: Callable[[int], Any], markers: Callable[[], Sequence[Any]], iters: int,
               warmup: int, on_steps: Callable[[StepTimes], None], barrier: Callable[[], None],
               wait: Wait, sync: Callable[[], None],
               clock: Callable[[], float] = time.perf_counter) -> tuple[float, list[Any]]:
    """Run ``iters`` steps; returns (wall seconds of the steps from index ``warmup`` on, what
    each ``step(i)`` returned, e.g. its loss on the device). ``on_steps`` has received every
    step's time, in order, when this returns. ``sync()`` waits until the device has finished
    all queued work."""
    watcher = StepWatcher(wait, clock)
    outputs: list[Any] = []
    ok = False
    try:
        window_start = clock()
        watcher.reset(window_start)
        for i in range(iters):
            if i == warmup:
                # Deliberate sync and barrier: the window starts with every rank idle and
                # aligned, so no warm-up work (compilation included) or a late rank is billed
                # to the measured steps. The watcher first, so that only one thread at a time
                # waits on the device (and an error the watcher met is raised here).
                watcher.catch_up()
                watcher.check()
                sync()
                on_steps(watcher.drain())
                barrier()
                window_start = clock()
                watcher.reset(window_start)
            outputs.append(step(i))
            watcher.submit(i, markers())
            watcher.check()
            on_steps(watcher.drain())
        watcher.catch_up()
        watcher.check()
        sync()  # deliberate: the window ends when the device has finished its work
        window_end = clock()
        on_steps(watcher.drain())
        ok = True
    finally:
        watcher.close(wait=ok)
    return window_end - window_start, outputs
