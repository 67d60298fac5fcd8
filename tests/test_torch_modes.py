"""torch's execution modes end to end on CPU: ``--mode compile`` (``torch.compile``, inductor)
reaches the worker, is recorded with its compile time (torch's own timing of its compilations,
spent inside the first step) and its compile count on every step, and trains as eager does;
eager records that it compiles nothing; a recompilation inside the window is counted and timed,
and flagged (the worker's test hook
``TRAINPERF_TEST_RECOMPILE_AT`` drops the compiled graphs mid-window); ``compile-cudagraphs``
is refused on a CPU in one line; and the compiled step aligns in float64 with torch eager on one
and two ranks, dp and mp.

Inductor keeps what it compiled in its cache on disk: the second compiled run of a graph
loads it instead of compiling again, so the runs here share one recipe and shape, and it is
``test_modes.py``'s (batch 4, 64 classes): a cold compilation of it costs over a minute of CPU
(its C++ kernels), a cached one seconds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from align_checks import align, assert_strictly_aligned
from run_util import left_behind
from trainperf import results
from trainperf.backends.torch.modes import RECOMPILE_AT_ENV
from trainperf.cli import main

pytestmark = pytest.mark.slow

WARMUP, ITERS = 2, 5
SHORT = ["--device", "cpu", "--devices", "1", "--runs", "1", "--iters", str(ITERS),
         "--warmup", str(WARMUP), "--batch-size", "4", "--num-classes", "64"]


def one_run(out: Path, mode: str, recompile_at: int | None = None
            ) -> tuple[dict, dict, list[int | None]]:
    """``trainperf run tiny-arcface --mode MODE`` on one CPU rank: its case, its run and the
    compile count of each of its steps."""
    if recompile_at is not None:
        os.environ[RECOMPILE_AT_ENV] = str(recompile_at)
    try:
        code = main(["run", "tiny-arcface", "--mode", mode, *SHORT, "--out", str(out)])
    finally:
        os.environ.pop(RECOMPILE_AT_ENV, None)
    [case] = results.load(out)["cases"]
    assert code == 0 or recompile_at is not None, case["runs"][0]["error"]
    return case, case["runs"][0], step_compiles(out)


def step_compiles(out: Path) -> list[int | None]:
    """``compiles`` of each ``step`` event in ``out`` (one run), in step order."""
    steps = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()
             if '"event": "step"' in line]
    assert [e["index"] for e in steps] == list(range(ITERS))
    return [e.get("compiles") for e in steps]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict, list[int | None]]]:
    """One eager run, one compiled run, and one compiled run whose graphs are dropped at the
    window's second step (it loads them back from inductor's cache, inside the window)."""
    base = tmp_path_factory.mktemp("modes")
    return {"eager": one_run(base / "eager", "eager"),
            "compile": one_run(base / "compile", "compile"),
            "recompiled": one_run(base / "recompiled", "compile", recompile_at=WARMUP + 1)}


def test_compile_reaches_the_worker_and_is_recorded(runs):
    case, run, _ = runs["compile"]
    assert run["status"] == "ok" and run["samples_per_s"] > 0, run["error"]
    assert run["mode"] == "compile"
    compiled = case["settings"]["torch_compile"]
    assert compiled["backend"] == "inductor" and compiled["wraps"] == "backbone and head"
    # tiny-arcface on a CPU runs channels-first: inductor is told to keep that layout.
    assert compiled["options"] == {"layout_optimization": False}
    # The compilation happened in the first step, inside the warm-up, and none in the window.
    assert run["first_step_s"] > 0 and run["compile_s"] > 0 and run["startup_s"] > 0
    assert run["first_step_s"] > max(run["step_times_s"])
    assert run["recompiles_in_window"] == 0 and "recompiled_in_window" not in run["flags"]
    _, eager, _ = runs["eager"]
    assert eager["mode"] == "eager" and eager["recompiles_in_window"] is None
    assert runs["eager"][0]["settings"]["torch_compile"] is None


def test_compile_time_is_torchs_own_and_spent_in_the_first_step(runs):
    """compile_s is what torch timed around its compilations, which run inside step 0 (a
    module compiles on its first call, its backward at the first backward): it cannot exceed
    that step's time. The compile count is known from step 0 and stops with the warm-up."""
    _, run, compiles = runs["compile"]
    assert 0 < run["compile_s"] <= run["first_step_s"]
    assert "TorchDynamo" in run["compile_measure"]
    assert "calculate_time_spent" in run["compile_measure"]
    assert None not in compiles and compiles[0] >= 1
    assert compiles == [compiles[0]] * ITERS
    _, eager, eager_compiles = runs["eager"]
    assert eager["compile_s"] == 0.0 and eager["compile_measure"] == "eager: nothing is compiled"
    assert eager_compiles == [None] * ITERS


def test_the_compiled_step_trains_as_eager_does(runs):
    """The same start, batch and step: the first loss agrees to float32's rounding, and the
    later ones stay close (inductor fuses and reorders, so they drift by rounding only)."""
    _, eager, _ = runs["eager"]
    _, compiled, _ = runs["compile"]
    assert compiled["loss_first"] == pytest.approx(eager["loss_first"], rel=1e-5)
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-3)


def test_a_recompilation_inside_the_window_is_flagged(runs):
    case, run, compiles = runs["recompiled"]
    assert run["mode"] == "compile" and run["recompiles_in_window"] >= 1
    # The step the graphs were dropped before compiled again: the count moved there alone, and
    # the compile time holds both compilations, each inside its own step.
    again = WARMUP + 1
    assert compiles[again] > compiles[again - 1] == compiles[0]
    assert compiles[again:] == [compiles[again]] * (ITERS - again)
    assert 0 < run["compile_s"] <= run["first_step_s"] + run["step_times_s"][again - WARMUP]
    assert "recompiled_in_window" in run["flags"]
    # Its window holds a compilation: its speed is left out of the case's figures.
    assert case["median_samples_per_s"] is None and case["ok_runs"] == 0
    # Otherwise the same run: its steps are timed and its losses those of the clean one.
    assert len(run["step_times_s"]) == ITERS - WARMUP
    assert run["losses"] == pytest.approx(runs["compile"][1]["losses"], rel=1e-5)


def test_cuda_graphs_are_refused_on_a_cpu_in_one_line(tmp_path, capsys):
    code = main(["run", "tiny-arcface", "--mode", "compile-cudagraphs", *SHORT,
                 "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith("trainperf: error:")
    assert "the torch backend runs --mode eager, compile on a CPU" in err
    assert "compile-cudagraphs needs a GPU" in err
    assert not (tmp_path / "r" / "results.json").exists()


def test_compiled_step_aligns_in_float64_on_two_ranks(tmp_path, capsys):
    # Two ranks, both heads: a compiled backbone under DDP and beside the sharded head. One
    # rank was checked by hand (`trainperf align tiny-arcface --framework torch --mode compile
    # --devices 1,2 --fc dp,mp`); each check compiles in float64, minutes on a cold cache.
    code, outcome = align("torch", tmp_path / "align", "2", "dp,mp", "--mode", "compile")
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert outcome["aligned"] and outcome["dtype"] == "float64", printed
    assert outcome["framework"] == "torch" and outcome["mode"] == "compile"
    assert {(c["fc"], c["ranks"]) for c in outcome["checks"]} == {("dp", 2), ("mp", 2)}
    for check in outcome["checks"]:
        assert_strictly_aligned(check)
    assert left_behind(tmp_path) == []
    # Each check's candidate compiled its step: its record says so, not only the request.
    candidates = sorted((tmp_path / "align" / "runs").glob("*/candidate-torch/results.json"))
    assert len(candidates) == 2
    for path in candidates:
        [case] = json.loads(path.read_text())["cases"]
        assert case["mode"] == "compile" and case["settings"]["torch_compile"], path
        # Under DDP (its optimizer compiles a subgraph per bucket) too, the compile time is
        # spent inside the first step.
        for run in case["runs"]:
            assert 0 < run["compile_s"] <= run["first_step_s"], path
