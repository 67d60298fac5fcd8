"""What every framework's strict-alignment tests assert of `trainperf align` (the main
environment: the CLI in-process, torch's side shared by the session's cache)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from trainperf.align.tensors import FLOAT64
from trainperf.cli import main

CONTROLS = ("no_weight_decay", "momentum", "no_clip", "straight_through")
"""The controls each framework's suite runs (``lr_schedule`` too runs in ``test_align.py``, torch
standing in as the candidate, and in ``trainperf align --controls``)."""

NAMES_WHAT_DIFFERS = re.compile(r"(backbone/\S+|head/weight)'s update|the (loss|grad norm|lr) by")


def align(framework: str, out: Path, devices: str, fc: str, *extra: str) -> tuple[int, dict]:
    """``trainperf align tiny-arcface`` of ``framework`` for 3 steps: its exit code and
    ``align.json``."""
    code = main(["align", "tiny-arcface", "--framework", framework, "--devices", devices,
                 "--fc", fc, "--steps", "3", *extra, "--out", str(out)])
    return code, json.loads((out / "align.json").read_text())


def assert_strictly_aligned(check: dict) -> None:
    """One (fc, ranks) pair aligned in float64: the same parameter count, tensors compared,
    every update, the start and the scalars within the base tolerance, and every rank of the
    pair compared."""
    assert check["aligned"], check["problems"]
    assert check["params"]["torch"] == check["params"]["other"] > 0
    assert check["tensors_compared"] > 0
    assert check["worst_update"]["error"] < FLOAT64.update
    assert check["worst_start"]["error"] == 0.0  # the float32 start, held exactly in float64
    for name in ("loss", "grad_norm", "lr"):
        assert check["worst_scalar"][name]["error"] < FLOAT64.scalar, name
    assert {s["rank"] for s in check["steps"]} == set(range(check["ranks"]))


def assert_every_control_caught(outcome: dict, controls: tuple[str, ...] = CONTROLS) -> None:
    """Each control ran, applied, and failed the check on a named tensor or scalar."""
    assert outcome["controls_caught"] is True
    assert set(outcome["controls"]) == set(controls)
    for name, c in outcome["controls"].items():
        assert c["applicable"] is True, (name, c["verdict"])
        assert c["caught"] and c["verdict"].startswith("caught: "), (name, c["verdict"])
        assert NAMES_WHAT_DIFFERS.search(c["verdict"]), (name, c["verdict"])


def assert_declared_only(outcome: dict, check: dict, ending: str | None) -> None:
    """The backend declares ``ending`` (or nothing) as its own rule: exactly those tensors are
    set apart, each measured past rounding; every other tensor was judged."""
    assert set(outcome["rule_differences"]) == ({ending} if ending else set())
    declared = {d["tensor"] for d in check["declared"]}
    expected = {e["tensor"] for e in check["all_errors"] if ending and e["tensor"].endswith(ending)}
    assert declared == expected
    assert all(d["error"] > FLOAT64.update for d in check["declared"])


def assert_one_rank_with_controls(framework: str, out: Path, capsys,
                                  declared: str | None = None) -> dict:
    """The suite's positive case with its negative controls: dp on one rank, aligned in
    float64, each control caught; returns the outcome."""
    code, outcome = align(framework, out, "1", "dp", "--controls", ",".join(CONTROLS))
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert outcome["aligned"] and outcome["dtype"] == "float64", printed
    [check] = outcome["checks"]
    assert (check["fc"], check["ranks"]) == ("dp", 1)
    assert_strictly_aligned(check)
    assert_declared_only(outcome, check, declared)
    if declared:
        assert "Declared differences" in printed
    assert_every_control_caught(outcome)
    return outcome
