"""Is one case's throughput different from another's: the ratio of their medians with a
bootstrap confidence interval, a rank test over their runs, and a verdict against a threshold.

The run is the unit of replication: a process start, memory placement and clocks change from run
to run, and the steps inside one window share them. So the rank test (Mann-Whitney U) and the
interval resample runs. Where a side has fewer than ``FEW_RUNS`` runs, each resampled run's
figure is itself resampled from blocks of its window's step times, so that the interval still
shows the noise it can see; the rank test still needs runs to decide.

scipy (the ``stats`` extra) does the statistics; ``available()`` says whether it is installed.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

CONFIDENCE = 0.95
ALPHA = 0.05
THRESHOLD = 0.02
FEW_RUNS = 5
POWER = 0.8
RESAMPLES = 4999
SEED = 0
MAX_RUNS_NEEDED = 1000
# The asymptotic standard error of a sample median over that of a mean, for normal data.
MEDIAN_SE_FACTOR = math.sqrt(math.pi / 2)


@dataclass(frozen=True)
class RunFigure:
    """One run's throughput and the step times of its counted window."""
    samples_per_s: float
    step_times_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class Comparison:
    """NEW against BASE: ``ratio`` is NEW's median samples/s over BASE's (above 1: faster)."""
    verdict: str
    ratio: float | None
    low: float | None
    high: float | None
    p_value: float | None
    base_runs: int
    new_runs: int
    interval_method: str
    runs_needed: int | None = None
    """Where the verdict is ``not enough runs``: about how many runs per side would decide,
    from the spread seen (None where one run per side shows no spread)."""

    @property
    def spans_one(self) -> bool:
        return self.low is not None and self.low <= 1.0 <= self.high

    def to_dict(self) -> dict:
        return asdict(self)


def available() -> bool:
    return importlib.util.find_spec("scipy") is not None


def require() -> None:
    if not available():
        raise ValueError("comparing results needs scipy: pip install 'trainperf[stats]'")


def usable_runs(case: dict) -> list[RunFigure]:
    """The runs a case's statistics count (``results.case_record``): ended ok, no flag."""
    return [RunFigure(r["samples_per_s"], tuple(r.get("step_times_s") or ()))
            for r in case["runs"]
            if r["status"] == "ok" and not r.get("flags") and r.get("samples_per_s")]


def min_runs_for_rank_test(alpha: float = ALPHA) -> int:
    """The fewest runs per side at which the two-sided exact Mann-Whitney U test can reach
    ``alpha`` at all: its smallest p-value is 2 / C(2n, n)."""
    n = 1
    while 2 / math.comb(2 * n, n) >= alpha:
        n += 1
    return n


def rank_test(base: Sequence[float], new: Sequence[float]) -> float | None:
    """Two-sided Mann-Whitney U p-value; None with fewer than one run a side."""
    from scipy.stats import mannwhitneyu

    if not base or not new:
        return None
    if len(set(base) | set(new)) == 1:
        return 1.0  # every run the same figure: nothing tells the sides apart
    return float(mannwhitneyu(new, base, alternative="two-sided").pvalue)


def _ratio_of_medians(new, base, axis=-1):
    return np.median(new, axis=axis) / np.median(base, axis=axis)


def _run_interval(base: list[RunFigure], new: list[RunFigure],
                  confidence: float) -> tuple[float, float]:
    from scipy.stats import bootstrap

    res = bootstrap(([r.samples_per_s for r in new], [r.samples_per_s for r in base]),
                    _ratio_of_medians, paired=False, vectorized=True, axis=-1,
                    confidence_level=confidence, n_resamples=RESAMPLES, method="percentile",
                    rng=np.random.default_rng(SEED))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _window_resamples(run: RunFigure, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` figures of one run, each from its window's step times resampled in moving
    blocks (length about the cube root of the window, which keeps a slow stretch together) and
    scaled to the run's recorded figure."""
    steps = np.asarray(run.step_times_s, dtype=float)
    m = len(steps)
    if m < 2 or steps.sum() <= 0:
        return np.full(count, run.samples_per_s)
    length = max(1, round(m ** (1 / 3)))
    blocks = math.ceil(m / length)
    cum = np.concatenate([[0.0], np.cumsum(steps)])
    starts = rng.integers(0, m - length + 1, size=(count, blocks))
    totals = (cum[starts + length] - cum[starts]).sum(axis=1) * (m / (blocks * length))
    return run.samples_per_s * cum[-1] / totals


def _side_medians(runs: list[RunFigure], count: int, rng: np.random.Generator) -> np.ndarray:
    figures = np.stack([_window_resamples(r, count, rng) for r in runs], axis=1)
    picks = rng.integers(0, len(runs), size=(count, len(runs)))
    return np.median(np.take_along_axis(figures, picks, axis=1), axis=1)


def _block_interval(base: list[RunFigure], new: list[RunFigure],
                    confidence: float) -> tuple[float, float]:
    rng = np.random.default_rng(SEED)
    ratios = _side_medians(new, RESAMPLES, rng) / _side_medians(base, RESAMPLES, rng)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)


def ratio_interval(base: list[RunFigure], new: list[RunFigure],
                   confidence: float = CONFIDENCE) -> tuple[float, float, float, str]:
    """(ratio of medians, low, high, how the interval was taken)."""
    ratio = float(_ratio_of_medians([r.samples_per_s for r in new],
                                    [r.samples_per_s for r in base]))
    if min(len(base), len(new)) >= FEW_RUNS:
        low, high = _run_interval(base, new, confidence)
        return ratio, low, high, "bootstrap over runs"
    low, high = _block_interval(base, new, confidence)
    return ratio, low, high, "bootstrap over runs and blocks of step times"


def relative_spread(runs: list[RunFigure]) -> float | None:
    """Standard deviation of a side's run figures over their median; None with one run."""
    rates = [r.samples_per_s for r in runs]
    if len(rates) < 2:
        return None
    return float(np.std(rates, ddof=1) / np.median(rates))


def runs_needed(base: list[RunFigure], new: list[RunFigure], ratio: float,
                threshold: float, confidence: float = CONFIDENCE) -> int | None:
    """About how many runs per side would place ``ratio``, with ``POWER`` odds, given the
    runs' pooled spread (as if the figures were normal):

    - where the change is beyond ``threshold``, enough that the interval of the medians clears
      the threshold, and that the rank test rejects "no difference" (Noether's sample size);
    - where it is within, enough that the interval fits inside the threshold.

    Never fewer than the rank test can decide with, nor than one more than now."""
    from scipy.stats import norm

    spreads = [s for s in (relative_spread(base), relative_spread(new)) if s is not None]
    if not spreads:
        return None
    spread = math.sqrt(sum(s * s for s in spreads) / len(spreads))
    change = abs(ratio - 1)
    beyond = change > threshold
    gap = abs(change - threshold)
    floor = max(min_runs_for_rank_test(1 - confidence), max(len(base), len(new)) + 1)
    if spread == 0:
        return floor
    if gap <= 0:
        return MAX_RUNS_NEEDED + 1
    z = float(norm.ppf(1 - (1 - confidence) / 2) + norm.ppf(POWER))
    need = 2 * (z * MEDIAN_SE_FACTOR * spread / gap) ** 2
    if beyond:
        # P(a NEW run beats a BASE run) for a shift of ``change`` between normal figures.
        p_beats = float(norm.cdf(change / (spread * math.sqrt(2))))
        need = max(need, z * z / (6 * (p_beats - 0.5) ** 2))
    return min(max(math.ceil(need), floor), MAX_RUNS_NEEDED + 1)


def compare_runs(base: list[RunFigure], new: list[RunFigure], threshold: float = THRESHOLD,
                 confidence: float = CONFIDENCE) -> Comparison:
    """The verdict on NEW against BASE. The threshold cuts the ratio's line in three: below
    1 - ``threshold``, within, above 1 + ``threshold``; a verdict needs the whole interval in
    one of them.

    - ``slower`` / ``faster``: the interval lies wholly below / above, and the rank test
      rejects "no difference" at 1 - ``confidence``.
    - ``no change``: the interval lies wholly within.
    - ``not enough runs``: it straddles a cut, so more runs would be needed to say
      (``runs_needed``).
    - ``no figure``: a side has no usable run.
    """
    require()
    if not base or not new:
        return Comparison("no figure", None, None, None, None, len(base), len(new), "-")
    ratio, low, high, method = ratio_interval(base, new, confidence)
    p = rank_test([r.samples_per_s for r in base], [r.samples_per_s for r in new])
    changed = p is not None and p < 1 - confidence
    if changed and high < 1 - threshold:
        verdict = "slower"
    elif changed and low > 1 + threshold:
        verdict = "faster"
    elif 1 - threshold <= low and high <= 1 + threshold:
        verdict = "no change"
    else:
        verdict = "not enough runs"
    needed = (runs_needed(base, new, ratio, threshold, confidence)
              if verdict == "not enough runs" else None)
    return Comparison(verdict, ratio, low, high, p, len(base), len(new), method, needed)


def compare_cases(base: dict, new: dict, threshold: float = THRESHOLD,
                  confidence: float = CONFIDENCE) -> Comparison:
    return compare_runs(usable_runs(base), usable_runs(new), threshold, confidence)
