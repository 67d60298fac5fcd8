"""Helpers for tests that run whole runs through the CLI."""

from __future__ import annotations

import statistics
from pathlib import Path

import psutil


def left_behind(folder: Path) -> list[psutil.Process]:
    """Live processes of runs under ``folder``: every process of a run (parameter servers,
    schedulers and launchers included) inherits TRAINPERF_RUN_ID, its run's folder, from the
    runner."""
    root = str(folder.resolve())
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TRAINPERF_RUN_ID", "").startswith(root):
                out.append(p)
        except psutil.Error:
            continue
    return out


PHASE_DELAY_S = 0.4
"""The sleep ``TRAINPERF_PHASE_DELAY`` puts in one phase of every profiled step in the tests: far
longer than any phase of a tiny step on a CPU, so that where it lands is unmistakable."""
BREAKDOWN = ["--breakdown", "--breakdown-steps", "4"]


def assert_delay_lands(case: dict, phase: str, delay: float = PHASE_DELAY_S) -> dict:
    """The case's profiled run was split into phases that add up to its step, the delay put in
    ``phase`` shows there and nowhere else, and no timed run saw it. Returns the breakdown."""
    bd = case["breakdown"]
    assert bd["status"] == "ok", bd["error"]
    times = bd["phases_s"]
    assert "other" in times and phase in times
    # Medians of each phase against the median step: equal up to how the steps vary.
    assert abs(bd["sum_s"] - bd["step_s"]) <= 0.1 * bd["step_s"]
    assert times[phase] >= delay
    assert all(v < delay for name, v in times.items() if name != phase), times
    assert bd["shares"][phase] == max(bd["shares"].values())
    for run in case["runs"]:
        # The timed runs never ran the delay: their steps are quicker than the profiled ones
        # by about it (a busy machine slows both).
        assert run["status"] == "ok"
        assert statistics.median(run["step_times_s"]) < bd["step_s"] - delay / 2
    return bd
