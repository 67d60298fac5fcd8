"""Helpers for tests that run whole runs through the CLI."""

from __future__ import annotations

import json
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
"""Four profiled steps: on several ranks two of them run without the gradient all-reduce."""


def assert_delay_lands(case: dict, phase: str, delay: float = PHASE_DELAY_S) -> dict:
    """The case's profiled run was split into phases that add up to its step, the delay put in
    ``phase`` shows there (and not in ``other``), and the case's statistics are its timed
    runs' alone.
    Returns the breakdown."""
    bd = case["breakdown"]
    assert bd["status"] == "ok", bd["error"]
    times = bd["phases_s"]
    assert "other" in times and phase in times
    # Medians of each phase against the steps: their sum lies within the steps' range, give
    # or take 10% for phases that vary apart from each other (a busy machine's doing).
    low, high = bd["step_s_range"]
    assert 0.9 * low <= bd["sum_s"] <= 1.1 * high, (bd["sum_s"], low, high)
    assert times[phase] >= delay
    # Not in `other`, where a stamp without its fence would leave it; no absolute bound on the
    # other phases: two ranks on a busy 2-core machine can take longer than the delay itself.
    assert times["other"] < delay / 2, times
    ok = [r["samples_per_s"] for r in case["runs"] if r["status"] == "ok"]
    assert ok and case["median_samples_per_s"] == statistics.median(ok)
    return bd


def assert_timed_runs_unprofiled(out: Path) -> None:
    """Every timed run of the folder ran without a profile and wrote no ``phases`` event: the
    profiled run (``*_profile``) is the only one that did."""
    for spec in out.rglob("runs/*/spec.json"):
        profiled = json.loads(spec.read_text())["profile"] is not None
        assert profiled == spec.parent.name.endswith("_profile"), spec
        events = (spec.parent / "events.jsonl").read_text()
        assert ('"event": "phases"' in events) == profiled, spec
