"""Helpers for tests that run whole runs through the CLI."""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from trainperf.backends import ports

_HELD: list[ports.Reservation] = []


def reserved_ports(n: int = 1, addr: str = "127.0.0.1") -> tuple[int, ...]:
    """Ports for a test's own listeners (a rendezvous store, a node's ranks), reserved as a run's
    are (``trainperf.backends.ports``) and held for the rest of the session: nothing else on the
    machine is handed them before the test's processes bind them."""
    held = ports.reserve(n, addr)
    _HELD.append(held)
    return held.ports


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
        # The run's own copy of its events is gone once the folder's stream holds them.
        assert not (spec.parent / "events.jsonl").exists(), spec
    for events in out.rglob("events.jsonl"):
        for e in map(json.loads, events.read_text().splitlines()):
            if e["event"] == "phases":
                assert e.get("profile") is True, events


@contextlib.contextmanager
def ports_taken_first() -> Iterator[list[socket.socket]]:
    """Inside: the ports of each framework's first launch on two or more ranks (on several
    nodes, node 0's, which every node learns when they meet) are taken by this process (bound,
    as another program on a busy host might bind them) after the runner chose them and before
    the run's processes could bind them. The listeners of that launch fail to bind; the run must start
    again on fresh ports and say so (``assert_started_again``)."""
    from trainperf.attempts import RunLauncher

    stolen: list[socket.socket] = []
    robbed: set[str] = set()
    choose = RunLauncher._ports

    def taking(self, case, meeting):
        cluster, held, addr = choose(self, case, meeting)
        if cluster.world_size > 1 and self.backend.name not in robbed:
            robbed.add(self.backend.name)
            for port in cluster.ports[0]:  # node 0's: the coordinator's among them
                s = socket.socket()
                s.bind((cluster.addrs[0], port))
                stolen.append(s)
        return cluster, held, addr

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RunLauncher, "_ports", taking)
        try:
            yield stolen
        finally:
            for s in stolen:
                s.close()


def assert_started_again(out: Path, case: str = "1n2g") -> dict:
    """The first run of ``case`` in ``out`` lost its ports before its first step (under
    ``ports_taken_first``), was started again on fresh ones and measured: its record, the
    events and the report say so, and the first attempt's files are kept apart. Returns the
    run's record."""
    doc = json.loads((out / "results.json").read_text())
    run = next(c for c in doc["cases"] if c["case"] == case)["runs"][0]
    assert run["status"] == "ok" and run["samples_per_s"] > 0, run["error"]
    [given_up] = run["retries"]
    assert given_up["attempt"] == 1
    assert given_up["reason"].endswith("taken by another process before the run's own could "
                                       "bind"), given_up
    assert (out / given_up["folder"] / "worker.log").exists()
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    # The given-up attempt's own events are in the folder's stream, before the retry.
    first = [e for e in events if e.get("case") == case and e.get("run") == 1
             and e["event"] in ("start", "exit", "error", "step", "run_retry")]
    assert first and "attempt" not in first[0], first[:1]
    retried = [e for e in events if e["event"] == "run_retry"]
    assert [(e["case"], e["run"], e["attempt"]) for e in retried] == [(case, 1, 1)]
    # A folder of several frameworks has one report, above each framework's results.
    report = out / "report.md" if (out / "report.md").exists() else out.parent / "report.md"
    assert f"- {case} b" in report.read_text().split("Runs started again on fresh ports")[1]
    return run


STALL_S = 3
"""The runs below stall for good: the stall timeout only has to outlast one tiny step."""


def assert_a_suspended_rank_is_named(framework: str, out: Path, *extra: str) -> str:
    """Two ranks; rank 1 suspends itself with SIGSTOP at step 1 (as ``kill -STOP`` from outside
    would), so rank 0 waits on it in the step's collective. Under ``--stall-timeout`` the run
    is stopped once it has gone that long without a step: a ``timeout`` that names rank 1 as
    suspended and since when, and where rank 0 was waiting; nothing is left running, the
    suspended rank included. Returns the error."""
    from trainperf.cli import main

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINPERF_FAULT", "stop@1:2/1")
        code = main(["run", "tiny-arcface", "--framework", framework, "--devices", "2",
                     "--runs", "1", "--iters", "4", "--warmup", "1", "--device", "cpu",
                     "--stall-timeout", str(STALL_S), *extra, "--out", str(out)])
    assert code == 1
    run = json.loads((out / "results.json").read_text())["cases"][0]["runs"][0]
    error = run["error"]
    assert run["status"] == "timeout", error
    head = "rank 1 was found suspended (stopped by SIGSTOP or a debugger) at step "
    assert error.startswith(head), error
    assert f"never resumed; then the run went {STALL_S} s without a step and was stopped as " \
           "hung; where each rank was: rank 0 in " in error, error
    assert "\n" not in error
    assert left_behind(out) == []
    return error
