"""``--mode best``: which of a framework's execution modes a case is timed in, from a short
probe of each. Standard library only.

The probe runs every mode the framework declares on the device, a few steps each after each
mode's own warm-up (its compilation), in rounds whose order alternates (A B, then B A), so that
a machine growing busier or quieter during the probe favours no mode. The mode with the highest
median rate over its rounds is chosen; a mode whose probe failed is never chosen while another
ran. The probe's figures, the choice and the margin over the runner-up are kept in the case's
record (``mode_probe``) and shown in the report; none of them enters the case's statistics.
"""

from __future__ import annotations

import statistics
from typing import Any

PROBE_ROUNDS = 2
"""Rounds over the modes: two, in opposite orders."""
PROBE_WARMUP_MAX = 5
"""Warm-up steps of a probe at most (fewer where the plan's own warm-up is shorter, 2 at
least: torch.compile and graph modes compile on the first step and may specialize on the
second)."""
PROBE_STEPS_MAX = 10
"""Timed steps of a probe at most (fewer where the plan's own window is shorter, 3 at least)."""


def probe_shape(warmup: int, window_steps: int) -> tuple[int, int]:
    """(warm-up, timed steps) of one probe run, from the plan's own."""
    return max(2, min(warmup, PROBE_WARMUP_MAX)), max(3, min(window_steps, PROBE_STEPS_MAX))


def probe_order(modes: list[str], rounds: int = PROBE_ROUNDS) -> list[tuple[int, str]]:
    """Every (round, mode) in the order they run: each round reverses the one before."""
    order = []
    for r in range(rounds):
        order += [(r, m) for m in (modes if r % 2 == 0 else list(reversed(modes)))]
    return order


def choose(modes: list[str], rates: dict[str, list[float | None]],
           errors: dict[str, str] | None = None, refused: dict[str, str] | None = None,
           ) -> dict[str, Any]:
    """The probe's outcome: each mode's rates and median, the chosen mode (the highest
    median; the first declared where none ran) and its margin over the runner-up. ``modes``
    in their declared order (the framework's default first); ``refused``: modes the case
    cannot run in, with why; ``errors``: why a mode's probe failed."""
    medians = {m: statistics.median([r for r in rates.get(m, []) if r is not None])
               for m in modes if any(r is not None for r in rates.get(m, []))}
    ranked = sorted(medians, key=lambda m: (-medians[m], modes.index(m)))
    chosen = ranked[0] if ranked else next((m for m in modes if m not in (refused or {})),
                                           modes[0])
    runner_up = ranked[1] if len(ranked) > 1 else None
    return {"chosen": chosen, "modes": modes, "rates": {m: rates.get(m, []) for m in modes},
            "medians": medians, "runner_up": runner_up,
            "margin": medians[chosen] / medians[runner_up] if runner_up else None,
            "errors": errors or {}, "refused": refused or {},
            "why": _why(chosen, modes, medians, refused or {}, runner_up)}


def _why(chosen: str, modes: list[str], medians: dict[str, float], refused: dict[str, str],
         runner_up: str | None) -> str:
    if len(modes) == 1:
        return "the only mode it declares on this device"
    if runner_up is not None:
        return f"{medians[chosen] / medians[runner_up]:.2f}x its {runner_up} mode in the probe"
    if chosen in medians:
        others = [m for m in modes if m != chosen]
        how = ", ".join(f"{m} {'refused' if m in refused else 'failed'}" for m in others)
        return f"the only mode whose probe ran ({how})"
    return "no mode's probe ran; the runs go on in its default"


def describe(framework: str, probe: dict[str, Any]) -> str:
    """One line for the report: ``paddle: dygraph, 1.37x its static mode in the probe``."""
    return f"{framework}: {probe['chosen']}, {probe['why']}"
