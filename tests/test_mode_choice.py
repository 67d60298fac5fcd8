"""How ``--mode best`` decides from its probe rounds (``mode_choice``): a mode that failed or
was flagged in any round loses to one that ran cleanly, a mode other than the default wins only
beyond the probe's spread, and a round's timed steps start where compilation stopped."""

from __future__ import annotations

import pytest

from trainperf import mode_choice
from trainperf.mode_choice import choose


def rounds(**rates) -> list[dict]:
    """Clean rounds of each mode at the given rates (None: a failed round)."""
    out = []
    for mode, values in rates.items():
        for i, v in enumerate(values):
            out.append({"mode": mode, "round": i, "status": "ok" if v is not None else "failed",
                        "samples_per_s": v, "flags": [], "settled": True,
                        "error": None if v is not None else "RuntimeError: boom"})
    return out


def test_a_clear_winner_is_chosen_with_its_margin():
    probe = choose(["eager", "compile"], rounds(eager=[100.0, 104.0], compile=[131.0, 129.0]))
    assert probe["chosen"] == "compile" and probe["runner_up"] == "eager"
    assert probe["margin"] == pytest.approx(130.0 / 102.0)
    assert probe["why"] == ("1.27x its default eager, beyond the probe's spread (rounds "
                            "129-131 vs 100-104 samples/s)")
    probe.update(wall_s=41.2, case="1n1g b8")
    assert mode_choice.describe("pytorch", probe).endswith("; probe 41 s on 1n1g b8")


def test_a_failed_round_loses_to_clean_ones_whatever_its_other_rate():
    probe = choose(["eager", "compile"], rounds(eager=[50.0, 52.0], compile=[None, 900.0]))
    assert probe["chosen"] == "eager"
    assert probe["clean"] == ["eager"] and "round 1: RuntimeError: boom" in probe["unclean"][
        "compile"]
    assert probe["runner_up"] is None and probe["margin"] is None


@pytest.mark.parametrize("trouble", [{"flags": ["loss_nonfinite"]}, {"flags": ["steps_skipped"]},
                                     {"settled": False, "timed_from": 9}])
def test_a_flagged_or_unsettled_round_is_not_clean(trouble):
    tried = rounds(eager=[50.0, 52.0], compile=[900.0, 910.0])
    tried[3].update(trouble)  # compile's second round
    probe = choose(["eager", "compile"], tried)
    assert probe["chosen"] == "eager" and "compile" in probe["unclean"]


def test_within_the_spread_the_default_stays_and_says_so():
    # compile's median is higher, but its slowest round is no faster than eager's fastest.
    probe = choose(["eager", "compile"], rounds(eager=[100.0, 110.0], compile=[108.0, 120.0]))
    assert probe["chosen"] == "eager"
    assert probe["why"].startswith("its default: no clear winner (compile 1.09x, rounds "
                                   "108-120 vs 100-110 samples/s")
    # Above the spread but within the noise floor: still no clear winner.
    probe = choose(["eager", "compile"], rounds(eager=[100.0, 100.0], compile=[101.0, 101.5]))
    assert probe["chosen"] == "eager" and "no clear winner" in probe["why"]


def test_a_default_that_failed_gives_way_to_the_fastest_clean_mode():
    probe = choose(["eager", "compile", "compile-cudagraphs"],
                   rounds(eager=[None, 100.0], compile=[120.0, 121.0],
                          **{"compile-cudagraphs": [150.0, 151.0]}))
    assert probe["chosen"] == "compile-cudagraphs" and probe["runner_up"] == "compile"
    assert probe["why"].startswith("the fastest mode that ran cleanly (its default eager")


def test_nothing_clean_leaves_a_default_that_ran_and_refused_modes_are_not_probed():
    tried = rounds(eager=[80.0, 90.0], static=[None, None])
    tried[0]["flags"] = ["loss_clamped"]  # eager ran every round, flagged in one
    probe = choose(["graph", "eager", "static"], tried,
                   refused={"graph": "1n2g b8: graph runs dp only"})
    assert probe["chosen"] == "eager" and probe["default"] == "eager"
    assert "no mode ran cleanly" in probe["why"] and "graph" not in probe["rates"]
    single = choose(["jit"], [])
    assert single["chosen"] == "jit" and single["why"] == "the only mode it declares on this device"
    one_left = choose(["function", "xla"], [], refused={"xla": "1n2g b8: no CPU collective"})
    assert one_left["chosen"] == "function"
    assert one_left["why"] == "the only mode every case can run (xla: 1n2g b8: no CPU collective)"


def test_a_default_that_failed_with_nothing_clean_is_no_choice():
    """Before, the default was timed anyway, though its own rounds had failed."""
    probe = choose(["eager", "compile"], rounds(eager=[None, 90.0], compile=[None, None]))
    assert probe["chosen"] is None and probe["runner_up"] is None
    assert probe["why"] == ("no mode ran cleanly in every round and its default eager failed "
                            "(round 1: RuntimeError: boom): no run was timed")
    assert mode_choice.describe("torch", probe).startswith("torch: no mode, no mode ran")
    assert mode_choice.trouble_in_runs(probe, {"case": "1n1g", "runs": []}) is None


def test_rounds_alternate_their_order_and_take_the_plans_shape():
    assert mode_choice.probe_order(["a", "b", "c"]) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]
    assert mode_choice.probe_shape(20, 100) == (10, 10)
    assert mode_choice.probe_shape(0, 1) == (4, 3)


def steps(compiles: list[int | None], slow: set[int] = frozenset()) -> list[dict]:
    return [{"index": i, "seconds": 1.0 if i in slow else 0.1, "compiles": c}
            for i, c in enumerate(compiles)]


def test_timed_steps_start_one_step_after_the_count_stops_moving():
    # Compiled in step 0 and again in step 2 (a second specialization); steps 3 settles.
    figures = mode_choice.round_figures(steps([1, 1, 2, 2, 2, 2, 2, 2], slow={0, 2, 3}), 4, 4,
                                        8)
    assert figures == {"timed_from": 4, "timed_steps": 4, "samples_per_s": pytest.approx(80.0),
                       "settled": True}
    # A framework that counts nothing (an eager mode): the fixed fallback.
    assert mode_choice.round_figures(steps([None] * 6), 4, 3, 8)["timed_from"] == \
        mode_choice.FALLBACK_WARMUP
    # Compiled beforehand (JAX): step 0 sees the count at 1 already, the steps from 2 count.
    assert mode_choice.round_figures(steps([1] * 6), 4, 3, 8)["timed_from"] == 2


def test_a_round_still_compiling_past_its_budget_has_no_rate():
    figures = mode_choice.round_figures(steps([1, 2, 3, 4, 5, 6, 6, 6, 6]), 4, 3, 8)
    assert figures["settled"] is False and figures["samples_per_s"] is None
    assert mode_choice.round_trouble({"status": "ok", **figures}).startswith("still compiling")


def test_trouble_in_the_timed_runs_names_the_runner_up():
    probe = choose(["eager", "compile"], rounds(eager=[100.0, 101.0], compile=[150.0, 152.0]))
    case = {"case": "1n2g", "batch_size_per_device": 8, "runs": [
        {"mode": "compile", "status": "failed", "flags": []},
        {"mode": "compile", "status": "ok", "flags": ["recompiled_in_window"]},
        {"mode": "compile", "status": "ok", "flags": []}]}
    line = mode_choice.trouble_in_runs(probe, case)
    assert line == ("1n2g b8: compile failed in 1 of 3 runs and recompiled inside the window "
                    "in 1; the probe's runner-up was eager (100 samples/s against 151)")
    case["runs"] = case["runs"][2:]
    assert mode_choice.trouble_in_runs(probe, case) is None
