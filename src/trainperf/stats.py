"""Statistics of runs and cases, following the methodology in DESIGN.md.

Throughput of a run is the samples of its counted window over the window's wall time, never a
mean of per-step rates. A case aggregates its successful runs: median, average, IQR. Speedup is
against the 1-device case at the same batch per device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

SUPERLINEAR = 1.05
SPREAD_LIMIT = 0.05
# -ln(1e-30): the value insightface's arcface_torch prints once its clamp of the target
# probability engages; a loss stuck there means training has diverged.
CLAMPED_LOSS = 69.0776


def median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if len(values) else None


def average(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def iqr(values: Sequence[float]) -> float | None:
    """Inter-quartile range with linear interpolation (numpy's default)."""
    if not len(values):
        return None
    q75, q25 = np.percentile(values, [75, 25])
    return float(q75 - q25)


@dataclass
class CaseStats:
    median: float | None
    average: float | None
    iqr: float | None
    ok_runs: int
    speedup: float | None = None
    scaling_efficiency: float | None = None
    flags: list[str] = field(default_factory=list)

    @property
    def spread(self) -> float | None:
        if self.median is None or self.iqr is None or self.median == 0:
            return None
        return self.iqr / self.median


def case_stats(run_rates: Iterable[float | None]) -> CaseStats:
    """Aggregate per-run throughputs; None marks a run that produced no figure."""
    rates = list(run_rates)
    ok = [r for r in rates if r is not None]
    stats = CaseStats(median(ok), average(ok), iqr(ok), len(ok))
    if len(ok) < len(rates):
        stats.flags.append("failed_runs")
    if stats.spread is not None and stats.spread > SPREAD_LIMIT:
        stats.flags.append("high_spread")
    return stats


def speedup(case_median: float | None, base_median: float | None) -> float | None:
    if case_median is None or not base_median:
        return None
    return case_median / base_median


def apply_scaling(cases: list[tuple[int, int, CaseStats]]) -> None:
    """Set speedup, efficiency and scaling flags on cases given as (world_size, batch, stats).

    The base of a case is the 1-device case with the same batch per device; without one,
    speedup stays None rather than being guessed.
    """
    base = {batch: s.median for world, batch, s in cases if world == 1 and s.median is not None}
    for world, batch, s in cases:
        s.speedup = speedup(s.median, base.get(batch))
        if s.speedup is not None:
            s.scaling_efficiency = s.speedup / world
            if s.scaling_efficiency > SUPERLINEAR:
                s.flags.append("superlinear")
    for batch in {b for _, b, _ in cases}:
        # Against strictly smaller cases only: a node sweep holds two cases of one size
        # (1n2g and 2n2g), neither of them smaller than the other.
        line = [(w, s) for w, b, s in cases if b == batch and s.median is not None]
        for world, s in line:
            smaller = [o.median for w, o in line if w < world]
            if smaller and s.median < max(smaller):
                s.flags.append("throughput_falls")


def loss_flags(loss_last: float | None, nonfinite: int = 0) -> list[str]:
    """Flags for a run whose loss says the measured steps are not a valid training."""
    flags = []
    if nonfinite or (loss_last is not None and not np.isfinite(loss_last)):
        flags.append("loss_nonfinite")
    elif loss_last is not None and abs(loss_last - CLAMPED_LOSS) < 1e-3:
        flags.append("loss_clamped")
    return flags
