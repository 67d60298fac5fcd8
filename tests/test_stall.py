"""The stall limit (``trainperf.stall``): on by default and sized from the case's step times, a
fixed or no limit on request, a real hang stopped by it long before ``--timeout``, the value each
run ran under in its record and the report, and folders measured before it still resuming."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from trainperf import results
from trainperf.cli import main
from trainperf.cli.common import add_run_options, measure_from_args
from trainperf.config import STALL_FLOOR_S, Measure
from trainperf.protocol import Step
from trainperf.report.limits import stall_line
from trainperf.report.markdown import describe
from trainperf.stall import FLOOR_S, STEP_MULTIPLE, StallSizing, limit_s, steady_steps


# -- the rule --------------------------------------------------------------------------------

def test_the_floor_holds_until_steps_are_known_then_a_multiple_of_their_median():
    m = Measure()
    assert FLOOR_S == STALL_FLOOR_S == 300.0 and STEP_MULTIPLE == 20.0
    assert limit_s(m, []) == 300.0
    # Fast steps never bring the limit under the floor.
    assert limit_s(m, [0.05, 0.06, 0.04]) == 300.0
    # Slow steps: 20x their median (18 s), rounded up to a whole second.
    assert limit_s(m, [17.0, 18.0, 90.0]) == 360.0
    assert limit_s(m, [15.01]) == math.ceil(20 * 15.01) == 301.0
    assert limit_s(Measure(stall_floor_s=10.0), [0.1]) == 10.0


def test_a_fixed_limit_or_none_on_request():
    assert limit_s(Measure(stall_timeout_s=42.0), [100.0]) == 42.0
    assert limit_s(Measure(stall_auto=False), [100.0]) is None
    with pytest.raises(ValueError, match="--stall-timeout off at once"):
        Measure(stall_timeout_s=5.0, stall_auto=False)
    with pytest.raises(ValueError, match="--stall-floor must be > 0"):
        Measure(stall_floor_s=0.0)


def test_a_runs_first_step_is_never_among_the_known_steps():
    # Step 0 took 90 s (a compilation): it must not make the limit 1,800 s.
    record = {"warmup_step_times_s": [90.0, 16.0], "step_times_s": [16.0, 17.0]}
    assert steady_steps(record) == [16.0, 16.0, 17.0]
    sizing = StallSizing(Measure(), [])
    sizing.saw([Step(index=0, seconds=90.0, samples=8, warmup=True)])
    assert sizing.limit_s() == 300.0
    sizing.saw([Step(index=1, seconds=16.0, samples=8, warmup=True),
                Step(index=2, seconds=17.0, samples=8, warmup=False)])
    assert sizing.limit_s() == 20 * 16.5
    # Earlier runs' steps count with this run's own.
    assert StallSizing(Measure(), [16.0] * 5).limit_s() == 320.0
    # A training run evaluates between its steps: no sized limit, a fixed one holds.
    assert StallSizing(Measure(), [16.0], sized=False).limit_s() is None
    assert StallSizing(Measure(stall_timeout_s=7.0), [], sized=False).limit_s() == 7.0


# -- the command line ------------------------------------------------------------------------

def measure_of(*argv: str) -> Measure:
    p = argparse.ArgumentParser()
    add_run_options(p)
    return measure_from_args(p.parse_args(["--device", "cpu", *argv]))


def test_the_command_line_sizes_fixes_or_turns_it_off():
    assert (measure_of().stall_timeout_s, measure_of().stall_auto) == (None, True)
    assert measure_of().stall_floor_s == 300.0
    assert measure_of("--stall-floor", "30").stall_floor_s == 30.0
    assert measure_of("--stall-timeout", "60").stall_timeout_s == 60.0
    off = measure_of("--stall-timeout", "off")
    assert (off.stall_timeout_s, off.stall_auto) == (None, False)


@pytest.mark.parametrize("argv,said", [
    (["--stall-timeout", "soon"], "--stall-timeout takes auto, off or seconds, got 'soon'"),
    (["--stall-timeout", "nan"], "--stall-timeout takes auto, off or seconds, got 'nan'"),
    (["--stall-timeout", "-3"], "--stall-timeout must be > 0, got -3.0"),
    (["--stall-timeout", "off", "--stall-floor", "30"],
     "--stall-floor sizes --stall-timeout auto, not --stall-timeout off"),
])
def test_a_bad_stall_option_is_one_line(argv, said, capsys):
    assert main(["run", "tiny-arcface", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"trainperf: error: {said}"


def test_a_folder_measured_before_keeps_its_plan():
    """``plan.json`` holds ``Measure.to_dict``; a folder measured before the stall fields
    existed wrote the dict below, and ``--resume`` compares them."""
    before = {"runs": 5, "iters": 120, "warmup": 20, "timeout_s": 1800.0,
              "memory_limit_bytes": None, "threads": None}
    assert Measure().to_dict() == before
    assert Measure(stall_timeout_s=60.0).to_dict() == {**before, "stall_timeout_s": 60.0}
    assert Measure.from_dict(before) == Measure()
    assert Measure(stall_auto=False).to_dict() == {**before, "stall_auto": False}
    assert Measure(stall_floor_s=30.0).to_dict() == {**before, "stall_floor_s": 30.0}


# -- the report ------------------------------------------------------------------------------

def doc_with(measure: dict, *limits: float | None) -> dict:
    runs = [{"run": i + 1, "stall_timeout_s": v} for i, v in enumerate(limits)]
    return {"recipe": "tiny-arcface", "workload": {}, "env": {},
            "measure": {"runs": len(runs), "iters": 10, "warmup": 2, "timeout_s": 1800.0,
                        **measure},
            "cases": [{"runs": runs}]}


def test_the_report_says_the_limit_each_run_ran_under():
    line = stall_line(doc_with({}, 300.0, 320.0))
    assert line == ("Stall timeout: 300 to 320 s (sized from the case's step times: 20x the "
                    "median step, at least 300 s): a run that goes that long without a step is "
                    "stopped as hung, before its 1800 s timeout.")
    assert line in describe(doc_with({}, 300.0, 320.0))
    assert stall_line(doc_with({"stall_timeout_s": 60.0}, 60.0)).startswith(
        "Stall timeout: 60 s (fixed by --stall-timeout): ")
    assert stall_line(doc_with({"stall_floor_s": 10.0}, 10.0)).startswith(
        "Stall timeout: 10 s (sized from the case's step times: 20x the median step, at "
        "least 10 s)")
    assert stall_line(doc_with({"stall_auto": False}, None)) == (
        "Stall timeout: off; only the 1800 s timeout stops a hung run.")
    # Results made before runs recorded it say nothing of it.
    old = doc_with({}, 1.0)
    del old["cases"][0]["runs"][0]["stall_timeout_s"]
    assert stall_line(old) is None and "Stall timeout" not in describe(old)


# -- real runs -------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_hung_run_is_stopped_by_the_sized_limit_long_before_its_timeout(tmp_path,
                                                                           monkeypatch):
    """The worker hangs for good at step 4 (``TRAINPERF_FAULT``); the sized limit, its floor
    lowered to 10 s so that the test is short, stops it, where the 600 s timeout would have
    waited. The error names the limit the record holds, which is the rule applied to the
    run's own steps before the hang."""
    from test_cli_run import processes_naming

    monkeypatch.setenv("TRAINPERF_FAULT", "hang@4")
    out = tmp_path / "r"
    rc = main(["run", "tiny-arcface", "--devices", "1", "--runs", "1", "--iters", "12",
               "--warmup", "4", "--device", "cpu", "--timeout", "600", "--stall-floor", "10",
               "--out", str(out)])
    assert rc == 1
    run = results.load(out)["cases"][0]["runs"][0]
    limit = run["stall_timeout_s"]
    assert run["status"] == "timeout" and run["samples_per_s"] is None
    assert limit == limit_s(Measure(stall_floor_s=10.0), steady_steps(run))
    assert 10.0 <= limit < 600.0
    assert run["error"].startswith(f"run went {limit:g} s without a step and was stopped as "
                                   "hung at step 4; where each rank was: rank 0 in inject "
                                   "(faults.py:"), run["error"]
    assert f"Stall timeout: {limit:g} s (sized" in (out / "report.md").read_text()
    assert processes_naming(tmp_path) == []


@pytest.mark.slow
def test_a_folder_measured_before_the_stall_limit_resumes(tmp_path):
    """A folder whose plan, events and first run were written before runs recorded a stall
    limit (its plan.json as the older code wrote it, run 1's record without the field), cut
    while run 2 ran: ``--resume`` takes it, keeps run 1 and measures run 2 under the sized
    limit, which run 2 records."""
    out = tmp_path / "r"
    args = ["run", "tiny-arcface", "--devices", "1", "--runs", "2", "--iters", "6",
            "--warmup", "2", "--device", "cpu"]
    assert main([*args, "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["measure"] == {"runs": 2, "iters": 6, "warmup": 2, "timeout_s": 1800.0,
                               "memory_limit_bytes": None, "threads": None}
    lines = (out / "events.jsonl").read_text().splitlines()
    cut = next(i for i, line in enumerate(lines)
               if json.loads(line).get("event") == "run_start" and json.loads(line)["run"] == 2)
    kept = []
    for line in lines[:cut]:
        event = json.loads(line)
        if event.get("event") == "run_end":
            del event["record"]["stall_timeout_s"]
        kept.append(json.dumps(event))
    (out / "events.jsonl").write_text("\n".join(kept) + "\n")
    assert main([*args, "--resume", str(out)]) == 0
    first, second = results.load(out)["cases"][0]["runs"]
    assert "stall_timeout_s" not in first
    assert second["status"] == "ok" and second["stall_timeout_s"] == 300.0
    assert "Stall timeout: 300 s (sized" in (out / "report.md").read_text()


@pytest.mark.slow
def test_a_follower_holds_rank_0s_steps_to_the_limit_node_0_sized(tmp_path, monkeypatch):
    """Two nodes on loopback; rank 0 (node 0) takes a second more at steps 1 to 4, so that its
    sized limit (20x their median, 20 s or more) lies well above the 10 s floor, then hangs for
    good at step 5. Node 1 sees no step of its own: it holds rank 0's steps, as node
    0's beats tell them, to the limit node 0 sized from them, which the beats carry too (not
    to its own, the bare floor), and both nodes stop the run as hung under that one limit."""
    import threading

    from run_util import left_behind, reserved_ports

    slow = ",".join(f"sleep=1@{i}:2" for i in range(1, 5))
    monkeypatch.setenv("TRAINPERF_FAULT", f"{slow},hang@5:2")
    port = str(reserved_ports()[0])
    codes = {}

    def node(rank: int) -> None:
        codes[rank] = main(["run", "tiny-arcface", "--devices", "1", "--nnodes", "2",
                            "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                            "--master-port", port, "--runs", "1", "--iters", "10",
                            "--warmup", "2", "--device", "cpu", "--timeout", "600",
                            "--stall-floor", "10", "--out", str(tmp_path / f"node{rank}")])

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == {0: 1, 1: 1}
    lead = results.load(tmp_path / "node0")["cases"][0]["runs"][0]
    follower = json.loads((tmp_path / "node1" / "results.json").read_text())
    told = follower["cases"][0]["runs"][0]
    assert lead["status"] == told["status"] == "timeout", (lead["error"], told["error"])
    sized = limit_s(Measure(stall_floor_s=10.0), steady_steps(lead))
    assert sized >= 20.0 and lead["stall_timeout_s"] == sized
    assert told["stall_timeout_s"] == sized
    assert f"run went {sized:g} s without a step and was stopped as hung" in lead["error"]
    assert left_behind(tmp_path) == []
