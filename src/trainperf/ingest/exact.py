"""The ``exact`` figure of an ingested run: samples over elapsed wall time across a window of
prints, from the best source the log has (line timestamps, printed seconds, printed rates)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .prints import Print


@dataclass
class Exact:
    value: float | None
    how: str
    """One line: which elapsed time was used (or why there is no figure)."""


def advanced_steps(prints: list[Print]) -> int:
    """Steps the run advanced from the first of these prints to the last. A print naming the
    same step as the print before it is another node's line for that step (PLSC on several
    nodes) and advances none."""
    return sum(p.steps for previous, p in zip(prints, prints[1:]) if p.index != previous.index)


def from_timestamps(window: list[Print], before: Print | None,
                    samples_per_step: int) -> Exact | None:
    """Samples over the wall-clock span between line timestamps; None where a print involved
    has no timestamp, or where the window holds no steps."""
    first = before if before is not None else window[0]
    counted_prints = window if before is not None else window[1:]
    if not counted_prints or any(p.timestamp is None for p in (first, *window)):
        return None
    span = (window[-1].timestamp - first.timestamp).total_seconds()
    if span <= 0:
        return Exact(None, "line timestamps give no positive span (absl/glog times carry no "
                           "year)")
    steps = advanced_steps([first, *counted_prints])
    return Exact(steps * samples_per_step / span,
                 f"exact: wall-clock span between the line timestamps at steps {first.index} "
                 f"and {window[-1].index}, logging included, as DLPerf's *_time.py scripts "
                 "compute")


def from_printed_seconds(window: list[Print], samples_per_step: int) -> Exact | None:
    if any(p.seconds is None for p in window) or sum(p.seconds for p in window) <= 0:
        return None
    return Exact(sum(p.steps for p in window) * samples_per_step / sum(p.seconds for p in window),
                 "exact: the seconds the log printed for each interval of the window")


def from_printed_rates(window: list[Print], rate_factor: int) -> Exact:
    if any(not (p.rate > 0 and math.isfinite(p.rate)) for p in window):
        return Exact(None, "exact: a printed rate in the window is not a positive number")
    elapsed_per_sample = sum(p.steps / p.rate for p in window)
    return Exact(rate_factor * sum(p.steps for p in window) / elapsed_per_sample,
                 "exact: no usable timestamps or printed seconds, so the window's time is "
                 "derived from each print's steps and rate (steps-weighted harmonic mean)")


def exact_throughput(window: list[Print], before: Print | None, samples_per_step: int,
                     rate_factor: int) -> Exact:
    """Samples over elapsed wall time across the window, from the best source the log has."""
    if not window:
        return Exact(None, "exact: no prints in the window")
    timed = from_timestamps(window, before, samples_per_step)
    if timed is not None and timed.value is not None:
        return timed
    fallback = (from_printed_seconds(window, samples_per_step)
                or from_printed_rates(window, rate_factor))
    if timed is not None:  # timestamps were there but unusable: say so before the fallback
        fallback.how = f"{timed.how}; {fallback.how}"
    return fallback
