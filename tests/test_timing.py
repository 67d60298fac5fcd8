"""The measured loop on fake clocks: the window holds exactly the steps after warm-up, every step
gets its own time, and on a GPU no step's time is lost to an event still pending."""

from __future__ import annotations

import pytest
import torch

from trainperf.backends.torch.timing import CudaStepTimer, HostStepTimer, timed_loop

# Distinct durations, so a window or an index off by one gives a different answer.
DURATIONS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]
WARMUP = 3
BARRIER_S = 1000.0  # a slow rank: the window must not pay for waiting at the barrier


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_loop(timer, clock: FakeClock):
    seen: list[tuple[int, float]] = []
    calls = iter(range(len(DURATIONS)))

    def step() -> torch.Tensor:
        i = next(calls)
        clock.now += DURATIONS[i]
        return torch.tensor(float(i))

    def barrier() -> None:
        clock.now += BARRIER_S

    window_s, losses = timed_loop(step, len(DURATIONS), WARMUP, timer, seen.extend, barrier)
    return window_s, losses, seen


def test_window_is_the_steps_after_warmup_exactly():
    clock = FakeClock()
    window_s, losses, seen = run_loop(HostStepTimer(clock), clock)
    assert window_s == sum(DURATIONS[WARMUP:])
    assert seen == list(enumerate(DURATIONS))  # every step once, in order, with its own time
    assert [float(x) for x in losses] == list(range(len(DURATIONS)))


class FakeEvent:
    """A CUDA event on a fake device: recorded at the fake time, complete only once the device
    has been synchronised after it (as a real event of work still queued)."""

    def __init__(self, clock: FakeClock, device: "FakeDevice") -> None:
        self.clock, self.device = clock, device
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.clock.now
        self.seq = self.device.recorded = self.device.recorded + 1

    def query(self) -> bool:
        return self.seq <= self.device.synced

    def synchronize(self) -> None:
        self.device.synced = max(self.device.synced, self.seq)

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "elapsed_time of an event that has not completed"
        return (end.at - self.at) * 1000.0


class FakeDevice:
    def __init__(self) -> None:
        self.recorded = 0
        self.synced = 0


def test_cuda_timer_reports_every_step_including_the_last():
    clock, device = FakeClock(), FakeDevice()
    timer = CudaStepTimer(torch.device("cuda", 0), lambda: FakeEvent(clock, device), clock)
    timer.sync = lambda: setattr(device, "synced", device.recorded)  # torch.cuda.synchronize
    window_s, _, seen = run_loop(timer, clock)
    assert window_s == sum(DURATIONS[WARMUP:])
    assert sorted(seen) == list(enumerate(DURATIONS))


def test_cuda_timer_drains_without_waiting_inside_the_window():
    clock, device = FakeClock(), FakeDevice()
    timer = CudaStepTimer(torch.device("cuda", 0), lambda: FakeEvent(clock, device), clock)
    timer.start()
    clock.now += 5.0
    timer.mark(0)
    assert timer.drain() == []  # pending: not waited for
    device.synced = device.recorded
    assert timer.drain() == [(0, pytest.approx(5.0))]
