"""Execution modes and memory formats: what reaches a worker and is recorded, what is refused,
how ``--mode best`` chooses, and where a recompilation inside the window shows."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mode_runs import stand_in_events
from trainperf import mode_choice, results
from trainperf.backends import BACKENDS, get_backend
from trainperf.cli import main
from trainperf.config import Measure, Topology, Tuning
from trainperf.plans import layout_for, parse_modes, throughput_plans
from trainperf.protocol import End, Step
from trainperf.recipes import get_recipe
from trainperf.run_kinds import TimedRun
from trainperf.runner import Case, Plan, Runner

CPU = Topology(device="cpu")


# ------------------------------------------------------- the runner's probe, stand-in modes
# (the rules of the choice itself: test_mode_choice.py)

def _two_mode_torch(monkeypatch, refuse=None):
    """torch as if it declared a second CPU mode (the worker never sees it: runs are stood in);
    ``refuse(workload, topology, tuning)`` a rule of its own."""
    torch = BACKENDS["torch"]
    caps = replace(torch.capabilities, modes={"cpu": ("eager", "fast"), "cuda": ("eager",)})
    monkeypatch.setitem(BACKENDS, "torch", replace(torch, capabilities=caps, refuse_more=refuse))


def stand_in_launches(runner: Runner, speed: dict[str, float], seen: list,
                      failing: set = frozenset()) -> None:
    """The runner's launches stood in: each mode at a known rate (samples/s), its step events
    with a compile count that moves in step 0 only; the timed runs ``failing`` names (mode,
    run) fail."""
    def launch(case, kind):
        mode = kind.mode(runner.modes.mode)
        world = case.topology.devices_per_node
        seen.append((type(kind).__name__, case.key.name, kind.run, mode))
        measure = kind.measure(runner.plan.measure)
        rate = speed[mode] * world * (1.0 + 0.001 * kind.run)
        events = stand_in_events(mode, rate, world, case.batch_size, measure)
        if isinstance(kind, TimedRun) and (mode, kind.run) in failing:
            return results.run_record(kind.run, events[:2], "failed", "RuntimeError: boom"), \
                events[:2]
        return results.run_record(kind.run, events, "ok"), events

    runner._launch = launch


def _plan(tmp_path, devices=(1, 2), runs=2, **changes) -> Plan:
    return Plan("tiny-arcface", get_recipe("tiny-arcface").workload, Measure(runs=runs, iters=12,
                warmup=4), [Case(replace(CPU, devices_per_node=d), 8) for d in devices],
                tmp_path, Tuning(mode="best"), **changes)


def test_best_probes_once_per_plan_and_times_every_case_in_its_choice(tmp_path, monkeypatch):
    _two_mode_torch(monkeypatch)
    runner = Runner(_plan(tmp_path))
    seen = []
    stand_in_launches(runner, {"eager": 100.0, "fast": 137.0}, seen)
    doc = runner.run()
    probes = [(case, run, mode) for kind, case, run, mode in seen if kind == "ProbeRound"]
    # Two rounds in opposite orders, on the plan's first case only.
    assert probes == [("1n1g", 1, "eager"), ("1n1g", 1, "fast"), ("1n1g", 2, "fast"),
                      ("1n1g", 2, "eager")]
    assert {mode for kind, _, _, mode in seen if kind == "TimedRun"} == {"fast"}
    probe = doc["mode_probe"]
    assert probe["chosen"] == "fast" and probe["case"] == "1n1g b8" and probe["wall_s"] >= 0
    assert probe["margin"] == pytest.approx(137.0 / 100.0, rel=0.01)
    assert [c["mode"] for c in doc["cases"]] == ["fast", "fast"]
    # One mode, so the 2-rank case has its speedup over the 1-rank one.
    assert doc["cases"][1]["speedup"] == pytest.approx(2.0, rel=0.01)
    assert all(r["after_mode_probe"] for c in doc["cases"] for r in c["runs"])
    # Kept as an event: a resumed folder keeps the choice and probes nothing again.
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["probe"]["chosen"] for e in events if e["event"] == "mode_probe"] == ["fast"]
    again = Runner(_plan(tmp_path))
    seen.clear()
    stand_in_launches(again, {"eager": 100.0, "fast": 137.0}, seen)
    again.run(resume=True)
    assert seen == [] and again.modes.mode() == "fast"


def test_a_mode_one_case_cannot_run_is_not_probed_and_no_ratio_crosses_modes(tmp_path,
                                                                              monkeypatch):
    """TensorFlow's shape: ``xla`` refused on several CPU ranks. The plan runs in the mode
    every case can run, with no probe; a document holding two modes computes no speedup across
    them."""
    _two_mode_torch(monkeypatch, refuse=lambda w, topo, t: (
        "fast runs on one rank" if t.mode == "fast" and topo.devices_per_node > 1 else None))
    runner = Runner(_plan(tmp_path))
    seen = []
    stand_in_launches(runner, {"eager": 100.0, "fast": 300.0}, seen)
    doc = runner.run()
    assert not [s for s in seen if s[0] == "ProbeRound"]
    assert doc["mode_probe"]["chosen"] == "eager"
    assert doc["mode_probe"]["refused"] == {"fast": "1n2g b8: fast runs on one rank"}
    assert [c["mode"] for c in doc["cases"]] == ["eager", "eager"]
    # The same cases as if each had run in its own mode: no speedup between them.
    cases = [dict(c) for c in doc["cases"]]
    cases[0]["mode"] = "fast"
    results.finish_cases(cases)
    assert cases[1]["speedup"] is None and "throughput_falls" not in cases[1]["flags"]


def test_a_real_data_plan_and_its_twin_share_one_probe(tmp_path, monkeypatch):
    from trainperf.runner import interleave, shared_choices

    _two_mode_torch(monkeypatch)
    twin = _plan(tmp_path / "synthetic", devices=(1,), runs=1, mode_group="pair",
                 data_role="synthetic baseline")
    real = replace(twin, out_dir=tmp_path / "real", data_role="real")
    runners = [Runner(p, shared=s) for p, s in zip([twin, real], shared_choices([twin, real]))]
    seen = []
    for r in runners:
        stand_in_launches(r, {"eager": 100.0, "fast": 150.0}, seen)
    docs = interleave(runners, [False, False])
    assert len([s for s in seen if s[0] == "ProbeRound"]) == 4  # one probe, not two
    assert [d["cases"][0]["mode"] for d in docs] == ["fast", "fast"]
    assert docs[1]["mode_probe"]["probed_in"] == "synthetic"
    assert "probed_in" not in docs[0]["mode_probe"]


def test_a_chosen_mode_that_fails_its_runs_is_said_with_the_runner_up(tmp_path, monkeypatch):
    from trainperf.report.markdown import render_report

    _two_mode_torch(monkeypatch)
    runner = Runner(_plan(tmp_path, devices=(1,)))
    stand_in_launches(runner, {"eager": 100.0, "fast": 150.0}, [], failing={("fast", 2)})
    doc = runner.run()
    report = render_report([doc])
    assert "- 1n1g b8: fast failed in 1 of 2 runs; the probe's runner-up was eager" in report


def test_best_probes_real_runs_and_records_the_choice(tmp_path):
    """Every mode torch declares here, probed in real runs; the timed run goes in the choice."""
    code = main(["run", "tiny-arcface", "--device", "cpu", "--mode", "best", "--runs", "1",
                 "--iters", "6", "--warmup", "2", "--batch-size", "4", "--num-classes", "64",
                 "--out", str(tmp_path / "out")])
    assert code == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    case = doc["cases"][0]
    probe = doc["mode_probe"]
    modes = list(get_backend("torch").modes_on("cpu"))
    assert probe["modes"] == modes
    assert case["runs"][0]["mode"] == probe["chosen"] == case["mode"]
    if len(modes) > 1:
        assert all(len(probe["rates"][m]) == 2 for m in modes)
        for r in probe["rounds"]:
            # Each round's timed steps start where its compile count stopped moving.
            assert r["status"] == "ok" and r["settled"] and r["samples_per_s"] > 0, r
            assert r["timed_from"] >= mode_choice.FALLBACK_WARMUP
    assert doc["tuning"]["mode"] == "best"
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"pytorch: {probe['chosen']}, " in report


@pytest.mark.slow
def test_a_plan_whose_every_mode_failed_its_probe_is_failed_not_timed(tmp_path, monkeypatch,
                                                                    capsys):
    """Every round of every mode fails (a fault at step 0, before anything compiles): no mode
    is chosen, no timed run is launched, and each run is recorded as failed with the probe's
    reason, where before the default was timed anyway."""
    monkeypatch.setenv("TRAINPERF_FAULT", "raise@0")
    out = tmp_path / "out"
    code = main(["run", "tiny-arcface", "--device", "cpu", "--mode", "best", "--runs", "2",
                 "--iters", "6", "--warmup", "2", "--batch-size", "4", "--num-classes", "64",
                 "--out", str(out)])
    capsys.readouterr()
    assert code == 1
    doc = results.load(out)
    probe = doc["mode_probe"]
    modes = list(get_backend("torch").modes_on("cpu"))
    assert probe["chosen"] is None and probe["clean"] == []
    assert {r["mode"] for r in probe["rounds"]} == set(modes)
    assert all(r["status"] == "failed" for r in probe["rounds"])
    assert probe["why"].startswith(f"no mode ran cleanly in every round and its default "
                                   f"{modes[0]} failed (round 1: ")
    (case,) = doc["cases"]
    assert [(r["run"], r["status"]) for r in case["runs"]] == [(1, "failed"), (2, "failed")]
    assert all(r["error"].startswith("not timed: --mode best found no mode to time")
               and r["samples_per_s"] is None for r in case["runs"])
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    launched = [e for e in events if e["event"] == "run_start"]
    assert launched and all("probe" in e for e in launched), launched  # probe rounds only
    assert "torch: no mode, no mode ran cleanly" in (out / "report.md").read_text()


# ------------------------------------------------------------------- what reaches a run

def test_the_mode_and_the_start_up_are_recorded_per_run(tmp_path):
    code = main(["run", "tiny-arcface", "--device", "cpu", "--mode", "eager", "--runs", "1",
                 "--iters", "5", "--warmup", "2", "--batch-size", "4", "--num-classes", "64",
                 "--out", str(tmp_path / "out")])
    assert code == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    run = doc["cases"][0]["runs"][0]
    assert run["mode"] == "eager" and doc["cases"][0]["settings"]["mode"] == "eager"
    # Start-up holds the launcher, the interpreter's and torch's imports: longer than the
    # first step.
    assert run["startup_s"] > run["first_step_s"] > 0
    assert run["first_step_excess_s"] == pytest.approx(
        max(run["first_step_s"] - sorted(run["step_times_s"])[len(run["step_times_s"]) // 2],
            0.0))
    assert run["compile_s"] == 0.0 and run["compile_measure"]  # eager compiles nothing
    assert run["after_mode_probe"] is False
    # The export and the published schema carry the real figures, not only empty ones.
    from trainperf import export

    (row,) = export.rows(tmp_path / "out")
    assert row["mode"] == "eager" and row["after_mode_probe"] is False
    for name in ("startup_s", "compile_s", "first_step_excess_s"):
        assert row[name] == pytest.approx(run[name]) and row[name] is not None
    (case_row,) = export.rows(tmp_path / "out", level="case")
    assert case_row["mode"] == "eager" and case_row["startup_s"] == pytest.approx(
        run["startup_s"])
    results.validate(doc)
    assert run["recompiles_in_window"] is None  # eager has nothing to count
    assert "| eager |" in (tmp_path / "out" / "report.md").read_text()


def test_a_recompilation_inside_the_window_is_flagged_and_left_out():
    steps = [Step(index=i, seconds=0.1, samples=8, warmup=i < 2) for i in range(6)]
    end = End(samples_per_s=80.0, window_s=0.4, window_samples=32, window_steps=4,
              loss_first=1.0, loss_last=0.9, recompiles_in_window=1)
    run = results.run_record(1, [*steps, end], "ok")
    assert run["flags"] == ["recompiled_in_window"] and run["recompiles_in_window"] == 1
    case = results.case_record(results.CaseKey(1, 1, 8), "fp32", [run], None)
    assert case["median_samples_per_s"] is None and case["recompiles_in_window"] == 1


@pytest.mark.parametrize("argv,needle", [
    (["--mode", "graph"], "the torch backend runs --mode eager"),
    (["--mode", "eager,eager"], "--mode names a mode twice"),
    (["--mode", "best,eager"], "--mode best stands alone"),
    (["--framework", "jax", "--mode", "eager"], "the jax backend runs --mode jit"),
])
def test_a_mode_a_framework_lacks_is_refused_in_one_line(tmp_path, capsys, argv, needle):
    code = main(["run", "tiny-arcface", "--device", "cpu", "--runs", "1", "--iters", "3",
                 "--warmup", "1", "--out", str(tmp_path / "out"), *argv])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out" / "events.jsonl").exists()


# ------------------------------------------------------------------------- the plans

def _plans(frameworks, modes=None, memory_format="auto", device="cpu"):
    return throughput_plans("tiny-arcface", {}, None, [1], Measure(runs=1, iters=3, warmup=1),
                            Tuning(memory_format=memory_format), Topology(device=device),
                            frameworks, Path("/tmp/unused"), modes=modes)


def test_comparisons_default_to_best_and_a_single_framework_to_its_default():
    assert [p.tuning.mode for p in _plans(["torch", "jax"])] == ["best", "best"]
    assert [p.tuning.mode for p in _plans(["torch"])] == ["default"]


def test_a_mode_list_sweeps_into_folders_of_their_own(monkeypatch):
    _two_mode_torch(monkeypatch)
    plans = _plans(["torch"], modes=parse_modes("eager,fast", ["torch"]))
    assert [(p.tuning.mode, p.out_dir.name, p.variant) for p in plans] == [
        ("eager", "eager", "eager"), ("fast", "fast", "fast")]


def test_real_data_with_a_mode_list_keeps_each_modes_plans_apart(monkeypatch, tmp_path):
    """`--data` with `--mode eager,fast`: each mode's real-data plan and synthetic twin in
    the mode's own folder, one probe group each (before, both modes wrote OUT/real and
    OUT/synthetic, and the second plan refused the first's folder)."""
    from trainperf.plans import open_data

    _two_mode_torch(monkeypatch)
    prefix = tmp_path / "faces"
    assert main(["data", "synth", "--identities", "4", "--images-per-identity", "3",
                 "--size", "32", "--val-pairs", "0", "--out", str(prefix)]) == 0
    data = open_data(str(prefix), "auto", 1)
    plans = throughput_plans("tiny-arcface", {"num_classes": 4}, None, [1],
                             Measure(runs=1, iters=3, warmup=1), Tuning(), CPU, ["torch"],
                             tmp_path / "out", data=data,
                             modes=parse_modes("eager,fast", ["torch"]))
    assert [(p.out_dir.relative_to(tmp_path / "out").as_posix(), p.tuning.mode, p.data_role)
            for p in plans] == [("eager/synthetic", "eager", "synthetic baseline"),
                                ("eager/real", "eager", "real"),
                                ("fast/synthetic", "fast", "synthetic baseline"),
                                ("fast/real", "fast", "real")]
    assert len({p.mode_group for p in plans}) == 2


def test_each_framework_runs_its_own_layout_unless_one_is_forced():
    # torch declares channels-last on a GPU (the H200 record: 1.5-2x NCHW), NCHW on a CPU.
    assert layout_for("torch", "auto", "cuda") is True
    assert layout_for("torch", "auto", "cpu") is False
    assert layout_for("torch", "channels_first", "cuda") is False
    assert layout_for("paddle", "auto", "cuda") is (
        get_backend("paddle").default_layout("cuda") == "channels_last")
    assert [p.workload.channels_last for p in _plans(["torch"], memory_format="channels_last")] \
        == [True]
    with pytest.raises(ValueError, match="channels-first only"):
        _plans(["paddle"], memory_format="channels_last")


def test_native_parity_rows_take_every_mode_a_framework_declares():
    from trainperf import parity

    assert parity.row_modes("torch", "cpu", "all") == list(get_backend("torch").modes_on("cpu"))
    assert parity.row_modes("jax", "cpu", "default") == ["jit"]
    with pytest.raises(ValueError, match="the jax backend runs --mode jit"):
        parity.row_modes("jax", "cpu", "graph")
