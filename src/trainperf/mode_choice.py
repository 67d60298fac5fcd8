"""``--mode best``: which of a framework's execution modes a plan is timed in, from a short
probe of each. Standard library only.

One mode per plan: the probe runs once, on the plan's first case, over the modes that every
case of the plan can run, and every timed run of the plan goes in the mode it chose, so that
speedups, efficiencies and a real-data plan's overhead over its synthetic twin (which takes the
same choice) always compare runs of one mode.

Each probe round is one short run of one mode. Its timed steps start once the framework's
compile count (``Step.compiles``) has stopped moving, one step after the last compilation
(``SETTLE_STEPS``), not after a fixed number of steps; a round still compiling when its step
budget runs out is not clean. Rounds alternate their order (A B, then B A), so that a machine
growing busier or quieter during the probe favours no mode.

The choice:

- A mode whose round failed, or was flagged (a non-finite or clamped loss, skipped fp16 steps,
  compilation that never settled), in any round is not clean, and is not chosen while another
  mode ran cleanly in every round.
- The framework's default (its first declared mode) stays unless another clean mode beats it
  clearly: that mode's slowest round faster than the default's fastest by more than
  ``NOISE_FLOOR``. Otherwise the default stays, and the record says "no clear winner" with the
  figures.
- Where the default is not clean, the clean mode with the highest median is chosen; where none
  is, the default stays if every round of it ran (a flag is a finding about the runs, which
  then show it), and the record says so.
- Where no mode ran cleanly and a round of the default failed, no mode is chosen
  (``chosen`` is None): the plan's runs are recorded as failed with the probe's reason, never
  timed in a mode the probe saw fail.

The rounds, the choice, the runner-up and the probe's wall time are kept in the plan's record
(``mode_probe``) and shown in the report; none of them enters the statistics.
"""

from __future__ import annotations

import statistics
from typing import Any

from .config import MODE_BEST

PROBE_ROUNDS = 2
"""Rounds over the modes: two, in opposite orders."""
SETTLE_MIN = 4
SETTLE_MAX = 10
"""Steps a probe round may spend compiling before its timed steps: the plan's own warm-up,
within these bounds."""
SETTLE_STEPS = 1
"""Steps after the last compilation that still do not count: the first run of freshly compiled
code grows allocators and autotunes."""
PROBE_STEPS_MIN = 3
PROBE_STEPS_MAX = 10
"""Timed steps of a probe round: the plan's own window, within these bounds."""
FALLBACK_WARMUP = 2
"""Where the framework cannot count its compilations (an eager mode), the timed steps start
after this many."""
NOISE_FLOOR = 0.02
"""A mode other than the default is chosen only where its slowest round beats the default's
fastest by more than this share."""
UNCLEAN_FLAGS = ("loss_nonfinite", "loss_clamped", "steps_skipped")
"""A round's run flags that make it unclean (``results.run_record``'s flags)."""


def probe_shape(warmup: int, window_steps: int) -> tuple[int, int]:
    """(steps a round may spend compiling, timed steps) of one probe round, from the plan's
    own warm-up and window: a round runs their sum."""
    return (max(SETTLE_MIN, min(warmup, SETTLE_MAX)),
            max(PROBE_STEPS_MIN, min(window_steps, PROBE_STEPS_MAX)))


def probe_order(modes: list[str], rounds: int = PROBE_ROUNDS) -> list[tuple[int, str]]:
    """Every (round, mode) in the order they run: each round reverses the one before."""
    order = []
    for r in range(rounds):
        order += [(r, m) for m in (modes if r % 2 == 0 else list(reversed(modes)))]
    return order


def settled_from(compiles: list[int | None]) -> int:
    """The first step of a round that counts: ``SETTLE_STEPS`` after the last step whose
    compile count moved (step 0 moves it where anything compiled before or in it), or
    ``FALLBACK_WARMUP`` where the framework counts nothing."""
    if all(c is None for c in compiles):
        return FALLBACK_WARMUP
    last = 0
    for i in range(1, len(compiles)):
        if compiles[i] != compiles[i - 1]:
            last = i
    return last + 1 + SETTLE_STEPS


def round_figures(steps: list[dict[str, Any]], settle_budget: int, timed_steps: int,
                  samples_per_step: int | None) -> dict[str, Any]:
    """A round's rate from its step events (``index``, ``seconds``, ``compiles``): the
    ``timed_steps`` steps from where compilation settled. ``settled`` is False where it had not
    settled within ``settle_budget`` steps (the rate is then None)."""
    steps = sorted(steps, key=lambda s: s["index"])
    start = settled_from([s.get("compiles") for s in steps])
    window = steps[start:start + timed_steps]
    settled = start <= settle_budget and len(window) == timed_steps
    seconds = sum(s["seconds"] for s in window)
    rate = (samples_per_step * len(window) / seconds
            if settled and samples_per_step and seconds > 0 else None)
    return {"timed_from": start, "timed_steps": len(window), "samples_per_s": rate,
            "settled": settled}


def round_trouble(round_: dict[str, Any]) -> str | None:
    """Why a round is not clean, in a few words; None where it is."""
    if round_.get("status") != "ok":
        return round_.get("error") or round_.get("status") or "failed"
    if not round_.get("settled", True):
        return (f"still compiling after {round_.get('timed_from', 0) - SETTLE_STEPS - 1} "
                "steps")
    flags = [f for f in round_.get("flags", []) if f in UNCLEAN_FLAGS]
    if flags:
        return "flagged " + ", ".join(flags)
    if not round_.get("samples_per_s"):
        return "no rate"
    return None


def choose(modes: list[str], rounds: list[dict[str, Any]],
           refused: dict[str, str] | None = None) -> dict[str, Any]:
    """The probe's outcome. ``modes``: the framework's modes on the device in declared order
    (its default first); ``rounds``: every probe round run (``mode``, ``round``, ``status``,
    ``samples_per_s``, ``flags``, ``settled``, ``error``); ``refused``: modes some case of the
    plan cannot run, with why."""
    refused = refused or {}
    runnable = [m for m in modes if m not in refused]
    default = runnable[0] if runnable else modes[0]
    rates = {m: [r.get("samples_per_s") for r in rounds if r["mode"] == m] for m in runnable}
    trouble: dict[str, str] = {}
    for r in rounds:
        why = round_trouble(r)
        if why and r["mode"] not in trouble:
            trouble[r["mode"]] = f"round {r['round'] + 1}: {why}"
    probed = [m for m in runnable if rates[m]]
    clean = [m for m in probed if m not in trouble]
    medians = {m: statistics.median(rates[m]) for m in clean}
    challengers = sorted((m for m in clean if m != default), key=lambda m: -medians[m])
    if default in clean:
        clear = [m for m in challengers if beats_clearly(rates[m], rates[default])]
        chosen = clear[0] if clear else default
    elif challengers:
        chosen = challengers[0]
    else:
        failed = any(r["mode"] == default and r.get("status") != "ok" for r in rounds)
        chosen = None if failed else default
    others = sorted((m for m in clean if m != chosen), key=lambda m: -medians[m])
    runner_up = others[0] if others and chosen in medians else None
    probe = {"chosen": chosen, "default": default, "modes": modes, "rounds": rounds,
             "rates": rates, "medians": medians, "clean": clean, "unclean": trouble,
             "refused": refused, "runner_up": runner_up,
             "margin": medians[chosen] / medians[runner_up] if runner_up else None}
    probe["why"] = _why(probe, probed)
    return probe


def beats_clearly(mode_rates: list[float], default_rates: list[float]) -> bool:
    """Whether a mode's slowest round beat the default's fastest by more than the floor."""
    return min(mode_rates) > max(default_rates) * (1.0 + NOISE_FLOOR)


def _span(rates: list[float]) -> str:
    low, high = min(rates), max(rates)
    return f"{low:.3g}" if low == high else f"{low:.3g}-{high:.3g}"


def _why(probe: dict[str, Any], probed: list[str]) -> str:
    chosen, default, rates = probe["chosen"], probe["default"], probe["rates"]
    runnable = [m for m in probe["modes"] if m not in probe["refused"]]
    if len(runnable) <= 1:
        if len(probe["modes"]) == 1:
            return "the only mode it declares on this device"
        refused = "; ".join(f"{m}: {w}" for m, w in probe["refused"].items())
        return f"the only mode every case can run ({refused})"
    if chosen is None:
        return (f"no mode ran cleanly in every round and its default {default} failed "
                f"({probe['unclean'][default]}): no run was timed")
    if not probe["clean"]:
        return "no mode ran cleanly in every round; the runs go on in its default"
    if chosen != default:
        if default not in probe["clean"]:
            why = probe["unclean"].get(default) or "not probed"
            return f"the fastest mode that ran cleanly (its default {default}: {why})"
        ratio = probe["medians"][chosen] / probe["medians"][default]
        return (f"{ratio:.2f}x its default {default}, beyond the probe's spread (rounds "
                f"{_span(rates[chosen])} vs {_span(rates[default])} samples/s)")
    best_other = max((m for m in probe["clean"] if m != default),
                     key=lambda m: probe["medians"][m], default=None)
    if best_other is None:
        return "its default, the only mode that ran cleanly"
    ratio = probe["medians"][best_other] / probe["medians"][default]
    figures = (f"{best_other} {ratio:.2f}x, rounds {_span(rates[best_other])} vs "
               f"{_span(rates[default])} samples/s")
    if ratio <= 1.0:
        return f"its default, the fastest in the probe ({figures})"
    return f"its default: no clear winner ({figures}, within the probe's spread)"


def describe(framework: str, probe: dict[str, Any]) -> str:
    """One line for the report: ``paddle: dygraph, its default: no clear winner (...); probe
    41 s on 1n1g b8``."""
    where = f" on {probe['case']}" if probe.get("case") else ""
    cost = (f"; probe {probe['wall_s']:.0f} s{where}"
            if probe.get("rounds") and probe.get("wall_s") is not None else "")
    chosen = probe["chosen"] or "no mode"
    return f"{framework}: {chosen}, {probe['why']}{cost}"


MODES_DIFFER = "modes differ"
"""The verdict of a pair of cases timed in two modes nobody asked for by name: no faster or
slower, since each figure is of another step."""


def modes_asked(docs: list[dict[str, Any]]) -> bool:
    """Whether every document's mode was asked for by name (``--mode eager``), so that a
    difference in mode between them is the user's question; a mode a probe chose
    (``--mode best``), or none recorded (an ingested log), is not."""
    return all((d.get("tuning") or {}).get("mode") not in (None, MODE_BEST) for d in docs)


def mode_pair_text(base: dict[str, Any], new: dict[str, Any]) -> str:
    """``modes differ (eager -> compile)``: the verdict cell of such a pair."""
    return f"{MODES_DIFFER} ({base.get('mode') or '-'} -> {new.get('mode') or '-'})"


def trouble_in_runs(probe: dict[str, Any], case: dict[str, Any]) -> str | None:
    """One line where the chosen mode failed or recompiled in a case's timed runs, naming the
    probe's runner-up; None where every run ran cleanly (or none ran: the probe's own line
    says why)."""
    if probe["chosen"] is None:
        return None
    runs = [r for r in case.get("runs", []) if r.get("mode") in (None, probe["chosen"])]
    failed = [r for r in runs if r.get("status") != "ok"]
    recompiled = [r for r in runs if "recompiled_in_window" in (r.get("flags") or [])]
    if not failed and not recompiled:
        return None
    what = []
    if failed:
        what.append(f"failed in {len(failed)} of {len(runs)} runs")
    if recompiled:
        what.append(f"recompiled inside the window in {len(recompiled)}")
    runner = probe.get("runner_up")
    after = (f"the probe's runner-up was {runner} ({probe['medians'][runner]:.3g} samples/s "
             f"against {probe['medians'][probe['chosen']]:.3g})" if runner
             else "the probe had no runner-up")
    return f"{case['case']} b{case['batch_size_per_device']}: {probe['chosen']} " \
           f"{' and '.join(what)}; {after}"
