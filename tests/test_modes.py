"""Execution modes and memory formats: what reaches a worker and is recorded, what is refused,
how ``--mode best`` chooses, and where a recompilation inside the window shows."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from trainperf import mode_choice, results
from trainperf.backends import BACKENDS, get_backend
from trainperf.cli import main
from trainperf.config import Measure, Topology, Tuning
from trainperf.plans import layout_for, parse_modes, throughput_plans
from trainperf.protocol import End, Start, Step
from trainperf.recipes import get_recipe
from trainperf.runner import Case, Plan, Runner

CPU = Topology(device="cpu")


# ------------------------------------------------------------------ the choice itself

def test_the_faster_mode_is_chosen_with_its_margin():
    probe = mode_choice.choose(["eager", "compile"],
                               {"eager": [100.0, 104.0], "compile": [131.0, 129.0]})
    assert probe["chosen"] == "compile" and probe["runner_up"] == "eager"
    assert probe["margin"] == pytest.approx(130.0 / 102.0)
    assert mode_choice.describe("pytorch", probe) == (
        "pytorch: compile, 1.27x its eager mode in the probe")


def test_a_mode_whose_probe_failed_is_never_chosen():
    probe = mode_choice.choose(["eager", "compile"], {"eager": [50.0, 52.0],
                                                      "compile": [None, 900.0]},
                               errors={"compile": "RuntimeError: boom"})
    # One failed round is enough: a mode that fails half its probes would fail runs too.
    assert probe["medians"] == {"eager": 51.0, "compile": 900.0}
    probe = mode_choice.choose(["eager", "compile"], {"eager": [50.0], "compile": [None]},
                               errors={"compile": "RuntimeError: boom"})
    assert probe["chosen"] == "eager" and probe["margin"] is None
    assert "compile failed" in probe["why"]


def test_no_mode_ran_leaves_the_default_and_refused_modes_are_skipped():
    probe = mode_choice.choose(["graph", "eager"], {"eager": [None]},
                               refused={"graph": "graph runs dp only"})
    assert probe["chosen"] == "eager" and probe["refused"] == {"graph": "graph runs dp only"}
    single = mode_choice.choose(["jit"], {})
    assert single["chosen"] == "jit" and single["why"] == "the only mode it declares on this device"


def test_rounds_alternate_their_order():
    assert mode_choice.probe_order(["a", "b", "c"]) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]
    assert mode_choice.probe_shape(20, 100) == (5, 10)
    assert mode_choice.probe_shape(0, 1) == (2, 3)


# ------------------------------------------------------- the runner's probe, stand-in modes

def _two_mode_torch(monkeypatch):
    """torch as if it declared a second CPU mode (the worker never sees it: runs are stood in)."""
    torch = BACKENDS["torch"]
    caps = replace(torch.capabilities, modes={"cpu": ("eager", "fast"), "cuda": ("eager",)})
    monkeypatch.setitem(BACKENDS, "torch", replace(torch, capabilities=caps))


def test_best_times_the_case_in_the_faster_of_two_stand_in_modes(tmp_path, monkeypatch):
    _two_mode_torch(monkeypatch)
    measure = Measure(runs=2, iters=12, warmup=4)
    plan = Plan("tiny-arcface", get_recipe("tiny-arcface").workload, measure, [Case(CPU, 8)],
                tmp_path, Tuning(mode="best"))
    runner = Runner(plan)
    factor = {"eager": 100.0, "fast": 137.0}  # the known difference between the two modes
    seen = []

    def stand_in(case, run, profile=False, probe=None):
        mode = probe or runner._tuning((case.key.name, case.batch_size)).mode
        seen.append((probe, run, mode))
        rate = factor[mode] * (1.0 + 0.01 * run)
        record = results.run_record(run, [
            Start(world_size=1, global_batch=8, device="cpu", env={}, workload={},
                  settings={"mode": mode}),
            *[Step(index=i, seconds=8 / rate, samples=8, warmup=i < 4) for i in range(12)],
            End(samples_per_s=rate, window_s=64 / rate, window_samples=64, window_steps=8,
                loss_first=1.0, loss_last=0.9)], "ok")
        return record

    runner._run_one = stand_in
    doc = runner.run()
    probes = [(p, r) for p, r, _ in seen if p]
    assert probes == [("eager", 1), ("fast", 1), ("fast", 2), ("eager", 2)]
    timed = [mode for p, _, mode in seen if not p]
    assert timed == ["fast", "fast"]
    case = doc["cases"][0]
    assert case["mode_probe"]["chosen"] == "fast"
    assert case["mode_probe"]["margin"] == pytest.approx(137.0 / 100.0, rel=0.02)
    assert [r["mode"] for r in case["runs"]] == ["fast", "fast"]
    # Kept as an event, so a resumed folder keeps the choice and probes nothing again.
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["probe"]["chosen"] for e in events if e["event"] == "mode_probe"] == ["fast"]
    again = Runner(plan)
    again._restore()
    assert again.probes[("1n1g", 8)]["chosen"] == "fast"


def test_best_probes_real_runs_and_records_the_choice(tmp_path):
    """Every mode torch declares here, probed in real runs; the timed run goes in the choice."""
    code = main(["run", "tiny-arcface", "--device", "cpu", "--mode", "best", "--runs", "1",
                 "--iters", "6", "--warmup", "2", "--batch-size", "4", "--num-classes", "64",
                 "--out", str(tmp_path / "out")])
    assert code == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    case = doc["cases"][0]
    probe = case["mode_probe"]
    modes = list(get_backend("torch").modes_on("cpu"))
    assert probe["modes"] == modes
    assert case["runs"][0]["mode"] == probe["chosen"] == case["mode"]
    if len(modes) > 1:
        assert all(len(probe["rates"][m]) == 2 and all(probe["rates"][m]) for m in modes)
    assert doc["tuning"]["mode"] == "best"
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"pytorch: {probe['chosen']}, " in report


# ------------------------------------------------------------------- what reaches a run

def test_the_mode_and_the_start_up_are_recorded_per_run(tmp_path):
    code = main(["run", "tiny-arcface", "--device", "cpu", "--mode", "eager", "--runs", "1",
                 "--iters", "5", "--warmup", "2", "--batch-size", "4", "--num-classes", "64",
                 "--out", str(tmp_path / "out")])
    assert code == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    run = doc["cases"][0]["runs"][0]
    assert run["mode"] == "eager" and doc["cases"][0]["settings"]["mode"] == "eager"
    # Start-up holds the interpreter's and torch's imports: longer than the first step.
    assert run["startup_s"] > run["first_step_s"] > 0
    assert run["compile_s"] == pytest.approx(
        max(run["first_step_s"] - sorted(run["step_times_s"])[len(run["step_times_s"]) // 2],
            0.0))
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
